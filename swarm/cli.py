"""``swarm``: train in one process, run a local swarm, watch a running one, run the benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import threading
import time
import tomllib

from swarm.coordinator.settings import CoordinatorSettings
from swarm.core.config import MODEL_PRESETS, PRECISIONS, SCHEDULES, RunConfig, TrainConfig, config_hash
from swarm.net.tls import add_arguments as tls_arguments

NO_BENCH = "swarm bench runs from a source checkout (bench/ is not installed)"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that override the run configuration (TOML file or the embedded default)."""
    g = parser.add_argument_group("run configuration")
    g.add_argument("--config", help="run configuration TOML (default: the embedded small run)")
    g.add_argument("--preset", choices=sorted(MODEL_PRESETS), help="model size preset")
    g.add_argument("--codec", choices=["identity", "subspace", "mapl"], help="boundary map")
    g.add_argument("--forward-format", help="activation tensor format (fp32, bf16, int8_row, rvq, topk...)")
    g.add_argument("--backward-format", help="tensor format of activation gradients")
    g.add_argument("--rank", type=int, help="subspace rank k (0: dense model)")
    g.add_argument("--stages", type=int, help="number of pipeline stages")
    g.add_argument("--steps", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--microbatches", type=int)
    g.add_argument("--schedule", choices=SCHEDULES, help="microbatch schedule of every stage (swarm runs)")
    g.add_argument("--precision", choices=PRECISIONS, help="layers' compute (bf16: autocast, fp32 weights)")
    g.add_argument(
        "--compile",
        action="store_const",
        const=True,
        help="torch.compile each layer (slower first step, faster ones after)",
    )
    g.add_argument(
        "--replicas", type=int, help="most nodes per stage (swarm runs; extra nodes join the slowest stage)"
    )
    g.add_argument("--lr", type=float)
    g.add_argument("--rotate-every", type=int, help="steps between subspace rotations (0: static)")
    g.add_argument("--checkpoint-every", type=int, help="steps between stage snapshot cuts (0: none)")
    g.add_argument(
        "--corpus",
        help="text file, folder or JSONL (default: the bundled Shakespeare plays), or a prepared corpus: "
        "its folder or mirror URLs (space-separated)",
    )
    g.add_argument("--corpus-id", help="the prepared corpus's id (swarm data prepare prints it)")
    g.add_argument("--tokenizer", choices=["bpe", "byte"])
    g.add_argument("--seed", type=int)


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The embedded default (:class:`RunConfig`'s defaults) or ``--config``, with every given flag on top.

    ``--preset`` without ``--seq-len`` shortens the sequence to the preset's context if it is longer.
    """
    if args.config:
        with open(args.config, "rb") as f:
            d = tomllib.load(f)
    else:
        d = RunConfig().to_dict()
    if args.preset:
        d["model"] = dataclasses.asdict(MODEL_PRESETS[args.preset])
        if args.seq_len is None:
            train = d.setdefault("train", {})
            train["seq_len"] = min(train.get("seq_len", TrainConfig.seq_len), d["model"]["max_seq_len"])
    overrides = {
        ("codec", "kind"): args.codec,
        ("codec", "forward_format"): args.forward_format,
        ("codec", "backward_format"): args.backward_format,
        ("model", "subspace_rank"): args.rank,
        ("train", "steps"): args.steps,
        ("train", "batch_size"): args.batch_size,
        ("train", "seq_len"): args.seq_len,
        ("train", "microbatches"): args.microbatches,
        ("train", "schedule"): args.schedule,
        ("train", "precision"): args.precision,
        ("train", "compile"): args.compile,
        ("train", "replicas"): args.replicas,
        ("train", "lr"): args.lr,
        ("train", "seed"): args.seed,
        ("rotation", "interval"): args.rotate_every,
        ("checkpoint", "interval"): args.checkpoint_every,
        ("data", "source"): args.corpus,
        ("data", "tokenizer"): args.tokenizer,
        ("data", "corpus"): args.corpus_id,
    }
    for (section, key), value in overrides.items():
        if value is not None:
            d.setdefault(section, {})[key] = value
    if args.stages is not None:
        d["n_stages"] = args.stages
    return RunConfig.from_dict(d)


def cmd_train(args: argparse.Namespace) -> int:
    from swarm.runtime.train import train

    config = run_config_from_args(args)
    print(f"run {config_hash(config)[:12]}: {config.to_json()}")
    s = train(config, device=args.device, out_dir=args.out, resume=args.resume)
    print(
        f"\n{s.steps} steps, {s.tokens} tokens in {s.seconds:.1f} s "
        f"({s.tokens / s.seconds:.0f} tok/s, {s.device})\n"
        f"validation loss {s.initial_val_loss:.3f} -> {s.final_val_loss:.3f}\n"
        f"wire bytes/token/boundary {s.wire_bytes_per_token:.1f} "
        f"(bf16 dense {s.dense_bytes_per_token:.0f}: {s.compression:.1f}x less)"
    )
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from swarm.launch.chaos import ChaosMonkey
    from swarm.launch.local_swarm import up

    config = run_config_from_args(args)
    print(
        f"run {config_hash(config)[:12]}: {config.n_stages} stages, codec {config.codec.kind}, "
        f"folder {args.run_dir}"
    )
    try:
        s = up(
            config,
            args.run_dir,
            nodes=args.nodes,
            stages_per_node=args.stages_per_node,
            link_mbps=args.link_mbps,
            link_latency_ms=args.link_latency_ms,
            device=args.device,
            use_dht=not args.no_dht,
            dead_after=args.dead_after,
            standbys=args.standbys,
            chaos=ChaosMonkey(args.chaos, args.seed or 0) if args.chaos > 0 else None,
            metrics_base_port=args.metrics_base_port,
            tls=args.tls,
            dial_only=args.dial_only,
            relay=args.relay,
        )
    except KeyboardInterrupt:
        print("\nstopped: every coordinator and node process was terminated")
        return 130
    dense = 4 * config.model.d_model  # bf16 activations forward + bf16 gradients backward
    print(
        f"\n{s.steps} steps, {s.tokens} tokens in {s.seconds:.1f} s "
        f"({s.tokens_per_second:.0f} tok/s steady-state)\n"
        f"training loss {s.losses[0]:.3f} -> {s.losses[-1]:.3f}\n"
        f"wire bytes/token/boundary {s.wire_bytes_per_token:.1f} "
        f"(bf16 dense {dense}: {dense / s.wire_bytes_per_token:.1f}x less)\n"
        f"logs: {args.run_dir}"
    )
    if s.model_dir is None:
        print(f"no trained model was written (the final cut's export): see {args.run_dir}/coordinator.err")
    else:
        sample = shlex.join(["swarm", "generate", "--model", str(s.model_dir), "--prompt", "ROMEO:"])
        print(f"trained model: {s.model_dir}\nsample from it: {sample}")
    if s.chaos is not None:
        c = s.chaos
        recovery = f"{c['mean_recovery_s']:.1f} s" if c["mean_recovery_s"] is not None else "n/a"
        redone = f"{c['mean_steps_redone']:.1f}" if c["mean_steps_redone"] is not None else "n/a"
        print(
            f"chaos: {c['kills']} nodes killed, {c['recovered']} recoveries measured, "
            f"mean recovery {recovery} (kill -> first step completed again), "
            f"{redone} steps redone per failure, {s.epochs_restarted} epochs restarted"
        )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print the run (once, or every ``--watch`` seconds until Ctrl-C); exit 1 if unreachable."""
    import grpc

    from swarm._proto.swarm.v1 import coordinator_pb2, coordinator_pb2_grpc
    from swarm.net import tls
    from swarm.ops.status import render, status_document

    security = tls.from_args(args, "swarm status", [args.coordinator], server=False)
    with security.channel(args.coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while True:
            try:
                reply = stub.Status(coordinator_pb2.StatusRequest(since_step=1 << 62), timeout=args.timeout)
                text = (
                    json.dumps(status_document(reply), indent=1)
                    if args.json
                    else render(reply, args.coordinator)
                )
            except grpc.RpcError as e:
                text = f"coordinator {args.coordinator} unreachable: {e.code().name}: {e.details()}"
                if not args.watch:
                    print(f"swarm status: {text}", file=sys.stderr)
                    return 1
            if args.watch:
                print("\x1b[H\x1b[2J", end="")  # clear the terminal, cursor home
            print(text, flush=True)
            if not args.watch:
                return 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from swarm.core.device import pick_device
    from swarm.io import model_io
    from swarm.serve.generate import Sampling, generate

    trained = model_io.load(args.model)
    sampling = Sampling(args.max_tokens, args.temperature, args.top_p, args.seed)
    if not args.servers:
        print(generate(trained, args.prompt, sampling, pick_device(args.device)))
        return 0
    from swarm.net import tls
    from swarm.serve.remote_generate import generate_remote, parse_servers

    servers = parse_servers(args.servers)
    addresses = [a for stage in servers.values() for a in stage]
    security = tls.from_args(args, "swarm generate", addresses, server=False)
    try:
        text, stats = generate_remote(
            trained, args.prompt, sampling, servers, args.boundary, args.format, security
        )
    except RuntimeError as e:  # every server of a stage failed, or one refused our requests
        print(f"swarm generate: {e}", file=sys.stderr)
        return 1
    print(text)
    per_boundary = ", ".join(f"{b:.1f}" for b in stats.bytes_per_token)
    print(
        f"{stats.decode_steps} tokens at {stats.tokens_per_second:.1f} tokens/s through the swarm; "
        f"frame bytes per token per boundary: {per_boundary}; failovers: {stats.failovers or 'none'}",
        file=sys.stderr,
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from swarm.io import model_io
    from swarm.io.hf_export import export_hf

    out = export_hf(model_io.load(args.model), args.hf)
    print(f"LlamaForCausalLM and its tokenizer written to {out} (load with from_pretrained)")
    return 0


def _checkout_root() -> str | None:
    """The source checkout this package runs from (the folder holding ``bench/``), if any."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return str(root) if (root / "bench" / "run.py").is_file() else None


def cmd_bench(args: argparse.Namespace) -> int:
    root = _checkout_root()
    if root is not None and root not in sys.path:  # an editable install: bench/ is next to swarm/
        sys.path.insert(0, root)
    try:
        from bench.run import main as bench_main
    except ModuleNotFoundError as e:  # an installed wheel: bench/ is a development tree
        if e.name not in ("bench", "bench.run"):
            raise
        print(f"swarm: error: {NO_BENCH}", file=sys.stderr)
        return 2
    out = args.out or ("results/bench-quick" if args.quick else "bench/results")
    only = args.only.split(",") if args.only else None
    started = time.monotonic()
    bench_main(args.quick, out, resume=args.resume, only=only, compute_profile=args.compute_profile)
    print(f"benchmarks done in {time.monotonic() - started:.0f} s: {out}/results.md, results.json, *.png")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from swarm.net import certs

    if args.action == "init":
        ca = certs.init(args.dir, args.host or certs.DEFAULT_COORDINATOR_HOSTS)
        print(
            f"CA {ca} and coordinator certificate written; serve with\n"
            f"  swarm-coordinator serve --tls-ca {ca} --tls-cert {args.dir}/coordinator.pem "
            f"--tls-key {args.dir}/coordinator.key\n"
            f"keep {args.dir}/ca.key offline; give each node ca.pem and its own pair (swarm certs issue)"
        )
        return 0
    cert = certs.issue_node(args.dir, args.name, args.host)
    key = cert.with_suffix(".key")
    print(
        f"{cert} written; join with\n"
        f"  swarm-node join --tls-ca {args.dir}/ca.pem --tls-cert {cert} --tls-key {key}"
    )
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    """``swarm data prepare`` (print the corpus id and counts) and ``swarm data verify``."""
    from swarm.io import shards

    if args.action == "verify":
        manifest = shards.verify_folder(args.dir, args.corpus)
        print(f"corpus {manifest.corpus_id}: every shard verified ({len(manifest.shards)} shards)")
        return 0
    if args.action == "serve":
        from swarm.io.data_server import DataServer

        try:  # Ctrl-C ends it cleanly wherever it lands, even before the wait or while closing
            with DataServer(args.dir, args.host, args.port) as server:
                print(f"corpus {server.manifest.corpus_id} served at {server.url}", flush=True)
                threading.Event().wait()
        except KeyboardInterrupt:
            return 0
    from swarm.io.prepare import PrepareOptions, prepare, resolve_tokenizer

    options = PrepareOptions(
        shard_tokens=args.shard_tokens,
        block_tokens=args.block_tokens,
        val_every=args.val_every,
        vocab_size=args.vocab_size,
        workers=args.workers,
    )
    start = time.perf_counter()
    manifest = prepare(args.src, args.out, resolve_tokenizer(args.tokenizer, args.src, options), options)
    train, val = manifest.counts("train"), manifest.counts("val")
    print(
        f"corpus {manifest.corpus_id} written to {args.out} in {time.perf_counter() - start:.1f} s: "
        f"{train['tokens']} training tokens ({train['docs']} documents), {val['tokens']} validation tokens "
        f"({val['docs']} documents), {len(manifest.shards)} shards of {manifest.dtype}, "
        f"vocabulary {manifest.n_ids}"
    )
    return 0


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    """``swarm data prepare|verify``."""
    from swarm.io.prepare import PrepareOptions

    p = sub.add_parser("data", help="prepare a corpus into verified token shards; verify or serve one")
    actions = p.add_subparsers(dest="action", required=True)
    prep = actions.add_parser(
        "prepare",
        help="tokenise a folder of .txt/.md, a .jsonl(.gz/.zst) file or a folder of them into shards",
    )
    prep.add_argument("src", nargs="?", help="the raw corpus (default: the bundled Shakespeare plays)")
    prep.add_argument("--out", required=True, help="the prepared folder (a previous one is replaced)")
    prep.add_argument(
        "--tokenizer", default="bpe", help="bpe (trained here), byte, or the path of a HF tokenizer.json"
    )
    d = PrepareOptions()
    prep.add_argument("--vocab-size", type=int, default=d.vocab_size, help="of a BPE trained here")
    prep.add_argument("--workers", type=int, default=d.workers, help="tokenising processes")
    prep.add_argument("--shard-tokens", type=int, default=d.shard_tokens, help="tokens per shard file")
    prep.add_argument(
        "--block-tokens", type=int, default=d.block_tokens, help="tokens per verified block (a Range read)"
    )
    prep.add_argument(
        "--val-every", type=int, default=d.val_every, help="every N-th document is validation (0: none)"
    )
    verify = actions.add_parser("verify", help="check a prepared folder against its manifest")
    verify.add_argument("dir", help="the prepared folder")
    verify.add_argument("--corpus", help="the corpus id it must have")
    serve = actions.add_parser("serve", help="serve a prepared folder over HTTP (with Range) until Ctrl-C")
    serve.add_argument("dir", help="the prepared folder")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    p.set_defaults(func=cmd_data)


def cmd_plan(args: argparse.Namespace) -> int:
    from swarm.core import plan
    from swarm.core.config import MODEL_PRESETS
    from swarm.core.profiles import load_profile

    if args.preset not in MODEL_PRESETS:
        raise SystemExit(f"swarm plan: unknown preset {args.preset!r}; choose from {sorted(MODEL_PRESETS)}")
    model = MODEL_PRESETS[args.preset]
    law = plan.GapLaw.load(args.law)
    link = plan.Link(args.mbps, args.rtt_ms)
    ranks = [int(k) for k in args.ranks.split(",")]
    candidates = plan.plan(
        model,
        load_profile(args.profile),
        link,
        law,
        ranks,
        args.stages,
        args.microbatches,
        args.microbatch_tokens,
        args.steps,
        args.optimizer,
    )
    best = plan.recommend(candidates, args.max_gap)
    print(
        f"{args.preset} (d={model.d_model}, {model.n_layers} layers) in {args.stages} stages on "
        f"{args.mbps:g} Mbit/s, {args.rtt_ms:g} ms RTT, compute {args.profile}; "
        f"{args.microbatches} microbatches of {args.microbatch_tokens} tokens (GPipe); {args.optimizer}"
    )
    if args.optimizer != law.optimizer:
        print(
            f"the law was fitted on {law.optimizer} runs: with {args.optimizer} only the ranks the grid "
            f"measured with it at d={model.d_model} are candidates "
            f"({len(candidates) - 1} here; gaps against dense on {args.optimizer})"
        )
    print(f"{'method':<20} {'tokens/s':>10} {'gap':>16} {'':<9} {'steps to dense loss':>20} {'sooner':>8}")
    for c in candidates:
        gap = "0" if c.rank == 0 else f"{100 * c.gap:+.1f}% ± {100 * c.uncertainty:.1f}"
        source = "" if c.rank == 0 else "measured" if c.measured else "law"
        mark = "  <- recommended" if c is best else ""
        print(
            f"{c.name:<20} {c.tokens_per_s:>10.0f} {gap:>16} {source:<9} {c.steps_factor:>19.2f}x "
            f"{c.speedup:>7.1f}x{mark}"
        )
    if best.measured:
        m = best.measured
        print(
            f"recommended settings (measured at d={m.d}, {len(m.seed_gaps)} seed(s)): model.subspace_rank = "
            f"{m.rank}, model.parametrisation = {m.parametrisation!r}, train.optimizer = {m.optimizer!r}, "
            f"train.lr = {m.lr:g}"
        )
    print(
        f"An estimate: gaps are the scaling bench's ({law.source}): measured at its widths, else its "
        f"law, extrapolated from them; steps and 'sooner' take the gap + its uncertainty; recommended: "
        f"the soonest to dense's loss whose gap <= {100 * args.max_gap:g}%."
    )
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from swarm.core.config import OPTIMIZERS
    from swarm.core.plan import DEFAULT_LAW

    p = sub.add_parser("plan", help="estimate tokens/s, quality gap and time to dense's loss per boundary")
    p.add_argument("--preset", default="2b-8layer", help="the model preset")
    p.add_argument("--profile", default="h200-2b-8layer-mb2048", help="a bundled compute profile or its file")
    p.add_argument("--mbps", type=float, default=80.0, help="link rate between stages (Mbit/s)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="round trip between stages (ms)")
    p.add_argument("--stages", type=int, default=8, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-tokens", type=int, default=2048)
    p.add_argument(
        "--ranks",
        default="10,20,40,80",
        help="candidate subspace ranks (those measured at the width join them)",
    )
    p.add_argument("--steps", type=int, default=1000, help="the horizon the gap is predicted at")
    p.add_argument("--max-gap", type=float, default=0.03, help="the largest predicted gap accepted")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=OPTIMIZERS,
        help="the layers' optimizer, for dense and the candidates alike (the law is AdamW's)",
    )
    p.add_argument("--law", default=str(DEFAULT_LAW), help="a law file or a scaling bench result")
    p.set_defaults(func=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    """The ``swarm`` parser: one subcommand each, its handler in ``func``."""
    parser = argparse.ArgumentParser(prog="swarm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train with all stages in this process (real codecs at every boundary)")
    add_run_arguments(p)
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1 ...")
    p.add_argument("--out", help="folder for summary.json")
    p.add_argument(
        "--resume",
        metavar="FILE",
        help="keep the run's progress in FILE at every evaluation and continue from it if present",
    )
    p.set_defaults(func=cmd_train)
    p = sub.add_parser(
        "up", help="a coordinator and one node process per stage on loopback, training together"
    )
    add_run_arguments(p)
    p.add_argument("--nodes", type=int, help="node processes (default: one per stages-per-node stages)")
    p.add_argument("--stages-per-node", type=int, default=1)
    p.add_argument("--link-mbps", type=float, default=0.0, help="emulated link rate per node (0: unlimited)")
    p.add_argument("--link-latency-ms", type=float, default=0.0, help="emulated one-way delay per node")
    p.add_argument("--device", default="cpu", help="device of every node (auto picks CUDA when present)")
    p.add_argument("--run-dir", default="runs/up", help="folder for logs, caches and coordinator state")
    p.add_argument("--no-dht", action="store_true", help="skip hivemind discovery")
    p.add_argument("--standbys", type=int, default=0, help="extra nodes waiting to replace a lost one")
    p.add_argument(
        "--dial-only",
        type=int,
        default=0,
        metavar="N",
        help="the first N nodes accept no inbound stream (--listen '', as behind NAT)",
    )
    p.add_argument(
        "--relay", action="store_true", help="the coordinator relays links between two dial-only nodes"
    )
    p.add_argument(
        "--chaos",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="kill -9 a random stage-hosting node this often (a fresh node joins in its place)",
    )
    p.add_argument(
        "--dead-after",
        type=float,
        default=CoordinatorSettings.dead_after_s,
        help="seconds without a heartbeat before a node is dead",
    )
    p.add_argument(
        "--metrics-base-port",
        type=int,
        metavar="P",
        help="serve /metrics: the coordinator on P (with /status), node i on P+1+i; printed at start",
    )
    p.add_argument("--tls", action="store_true", help="a fresh CA in --run-dir/certs; mutual TLS everywhere")
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("status", help="show a running swarm: the run, and a table of its nodes")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator's gRPC service")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh this often until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the JSON document (as its HTTP /status)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the coordinator")
    tls_arguments(p, server=False)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("certs", help="create the swarm's CA and sign coordinator and node certificates (TLS)")
    p.add_argument(
        "action", choices=["init", "issue"], help="init: a new CA + coordinator certificate; issue: a node's"
    )
    p.add_argument("--dir", default="swarm-certs", help="folder of the CA and the certificates")
    p.add_argument("--name", default="node", help="issue: the certificate's name (NAME.pem, NAME.key)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="host name or IP the certificate names (repeatable; init default: localhost, 127.0.0.1)",
    )
    p.set_defaults(func=cmd_certs)
    p = sub.add_parser("generate", help="sample text from a trained model folder (KV-cached)")
    p.add_argument(
        "--model", required=True, help="model folder (swarm train --out X: X/model; a coordinator's)"
    )
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate (stops at the context length)"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (deterministic)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda:0 ...")
    p.add_argument(
        "--servers",
        nargs="*",
        metavar="STAGE=HOST:PORT[,HOST:PORT]",
        help="generate through these swarm-node serve processes (spares after the first: failover)",
    )
    p.add_argument("--boundary", default="subspace", help="the servers' --boundary (subspace or dense)")
    p.add_argument("--format", default="bf16", help="the servers' --format (fp32, bf16, int8_row)")
    tls_arguments(p, server=False)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("export", help="export a trained model folder to Hugging Face transformers (LLaMA)")
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--hf", required=True, help="output folder for LlamaForCausalLM.from_pretrained")
    p.set_defaults(func=cmd_export)
    add_data_parser(sub)
    add_plan_parser(sub)
    p = sub.add_parser("bench", help="run the benchmarks; write JSON, a Markdown report and plots")
    p.add_argument("--quick", action="store_true", help="small smoke run (a few minutes; what CI runs)")
    p.add_argument(
        "--out", help="results folder (default: bench/results, or results/bench-quick with --quick)"
    )
    p.add_argument("--resume", action="store_true", help="keep the sections an interrupted run already saved")
    p.add_argument(
        "--only",
        help="comma-separated sections to rerun (e.g. paper_scale); the others are kept from --out "
        "(with no results there yet, only these run: include wire,overhead,convergence,throughput)",
    )
    p.add_argument(
        "--compute-profile",
        help="paper-scale section: a bundled profile name or a JSON file (bench.compute_profile)",
    )
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad arguments, a missing or corrupt file (ModelFormatError too)
        print(f"swarm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
