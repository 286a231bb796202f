from swarm._proto.swarm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_PHASE_UNSPECIFIED: _ClassVar[NodePhase]
    NODE_PHASE_JOINING: _ClassVar[NodePhase]
    NODE_PHASE_FETCHING: _ClassVar[NodePhase]
    NODE_PHASE_LOADING: _ClassVar[NodePhase]
    NODE_PHASE_READY: _ClassVar[NodePhase]
    NODE_PHASE_TRAINING: _ClassVar[NodePhase]
    NODE_PHASE_WAITING: _ClassVar[NodePhase]
    NODE_PHASE_LEAVING: _ClassVar[NodePhase]

class LinkRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LINK_ROLE_UNSPECIFIED: _ClassVar[LinkRole]
    LINK_ROLE_DIAL: _ClassVar[LinkRole]
    LINK_ROLE_ACCEPT: _ClassVar[LinkRole]
NODE_PHASE_UNSPECIFIED: NodePhase
NODE_PHASE_JOINING: NodePhase
NODE_PHASE_FETCHING: NodePhase
NODE_PHASE_LOADING: NodePhase
NODE_PHASE_READY: NodePhase
NODE_PHASE_TRAINING: NodePhase
NODE_PHASE_WAITING: NodePhase
NODE_PHASE_LEAVING: NodePhase
LINK_ROLE_UNSPECIFIED: LinkRole
LINK_ROLE_DIAL: LinkRole
LINK_ROLE_ACCEPT: LinkRole

class JoinRequest(_message.Message):
    __slots__ = ("protocol_version", "token", "node_name", "announce_address", "max_stages", "device", "relay_address")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    token: str
    node_name: str
    announce_address: str
    max_stages: int
    device: str
    relay_address: str
    def __init__(self, protocol_version: _Optional[int] = ..., token: _Optional[str] = ..., node_name: _Optional[str] = ..., announce_address: _Optional[str] = ..., max_stages: _Optional[int] = ..., device: _Optional[str] = ..., relay_address: _Optional[str] = ...) -> None: ...

class BoundaryLink(_message.Message):
    __slots__ = ("boundary", "local_stage", "peer_node_id", "peer_address", "role", "link_secret", "peer_certificate", "relay_address")
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LINK_SECRET_FIELD_NUMBER: _ClassVar[int]
    PEER_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    boundary: int
    local_stage: int
    peer_node_id: str
    peer_address: str
    role: LinkRole
    link_secret: str
    peer_certificate: str
    relay_address: str
    def __init__(self, boundary: _Optional[int] = ..., local_stage: _Optional[int] = ..., peer_node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., role: _Optional[_Union[LinkRole, str]] = ..., link_secret: _Optional[str] = ..., peer_certificate: _Optional[str] = ..., relay_address: _Optional[str] = ...) -> None: ...

class StageCheckpoint(_message.Message):
    __slots__ = ("stage", "step", "digest", "size", "chunk_bytes", "chunk_sha256", "holders", "at_coordinator")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHA256_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    AT_COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    stage: int
    step: int
    digest: str
    size: int
    chunk_bytes: int
    chunk_sha256: bytes
    holders: _containers.RepeatedCompositeFieldContainer[SnapshotHolder]
    at_coordinator: bool
    def __init__(self, stage: _Optional[int] = ..., step: _Optional[int] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., chunk_sha256: _Optional[bytes] = ..., holders: _Optional[_Iterable[_Union[SnapshotHolder, _Mapping]]] = ..., at_coordinator: _Optional[bool] = ...) -> None: ...

class SnapshotHolder(_message.Message):
    __slots__ = ("node_id", "address", "certificate", "access")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    certificate: str
    access: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., certificate: _Optional[str] = ..., access: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("epoch", "stages", "links", "resume_step", "restore", "replicas", "upload_snapshots", "rebuild", "evidence_secret", "rotation_lineage")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_SECRET_FIELD_NUMBER: _ClassVar[int]
    ROTATION_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    stages: _containers.RepeatedScalarFieldContainer[int]
    links: _containers.RepeatedCompositeFieldContainer[BoundaryLink]
    resume_step: int
    restore: _containers.RepeatedCompositeFieldContainer[StageCheckpoint]
    replicas: _containers.RepeatedCompositeFieldContainer[StageReplicas]
    upload_snapshots: bool
    rebuild: _containers.RepeatedScalarFieldContainer[int]
    evidence_secret: str
    rotation_lineage: int
    def __init__(self, epoch: _Optional[int] = ..., stages: _Optional[_Iterable[int]] = ..., links: _Optional[_Iterable[_Union[BoundaryLink, _Mapping]]] = ..., resume_step: _Optional[int] = ..., restore: _Optional[_Iterable[_Union[StageCheckpoint, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[StageReplicas, _Mapping]]] = ..., upload_snapshots: _Optional[bool] = ..., rebuild: _Optional[_Iterable[int]] = ..., evidence_secret: _Optional[str] = ..., rotation_lineage: _Optional[int] = ...) -> None: ...

class StageReplica(_message.Message):
    __slots__ = ("node_id", "microbatches", "averaging_address", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    microbatches: _containers.RepeatedScalarFieldContainer[int]
    averaging_address: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., microbatches: _Optional[_Iterable[int]] = ..., averaging_address: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class StageReplicas(_message.Message):
    __slots__ = ("stage", "replicas")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    replicas: _containers.RepeatedCompositeFieldContainer[StageReplica]
    def __init__(self, stage: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[StageReplica, _Mapping]]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("node_id", "run_id", "config_json", "config_hash", "embedding_digest", "embedding_size", "subspace_version", "heartbeat_interval_ms", "dht_initial_peers", "plan", "run_complete", "session", "reachable", "reachability", "snapshot_access")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUBSPACE_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    DHT_INITIAL_PEERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RUN_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ACCESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    config_json: str
    config_hash: str
    embedding_digest: str
    embedding_size: int
    subspace_version: int
    heartbeat_interval_ms: int
    dht_initial_peers: _containers.RepeatedScalarFieldContainer[str]
    plan: Plan
    run_complete: bool
    session: str
    reachable: bool
    reachability: str
    snapshot_access: str
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., config_json: _Optional[str] = ..., config_hash: _Optional[str] = ..., embedding_digest: _Optional[str] = ..., embedding_size: _Optional[int] = ..., subspace_version: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., dht_initial_peers: _Optional[_Iterable[str]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., run_complete: _Optional[bool] = ..., session: _Optional[str] = ..., reachable: _Optional[bool] = ..., reachability: _Optional[str] = ..., snapshot_access: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "step", "phase", "plan_epoch", "tokens_per_second", "subspace_version", "averaging_address", "capacity_tokens_per_second", "hold_ms", "cut_requests", "run_complete", "keep_orders")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SUBSPACE_VERSION_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    CUT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUN_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    KEEP_ORDERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    phase: NodePhase
    plan_epoch: int
    tokens_per_second: float
    subspace_version: int
    averaging_address: str
    capacity_tokens_per_second: float
    hold_ms: int
    cut_requests: int
    run_complete: bool
    keep_orders: int
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., phase: _Optional[_Union[NodePhase, str]] = ..., plan_epoch: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., subspace_version: _Optional[int] = ..., averaging_address: _Optional[str] = ..., capacity_tokens_per_second: _Optional[float] = ..., hold_ms: _Optional[int] = ..., cut_requests: _Optional[int] = ..., run_complete: _Optional[bool] = ..., keep_orders: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "plan_epoch", "subspace_version", "plan", "run_complete", "cut_requests", "session", "keep_orders", "keep", "audit_suspects")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SUBSPACE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RUN_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CUT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    KEEP_ORDERS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    AUDIT_SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    plan_epoch: int
    subspace_version: int
    plan: Plan
    run_complete: bool
    cut_requests: int
    session: str
    keep_orders: int
    keep: _containers.RepeatedCompositeFieldContainer[StageCheckpoint]
    audit_suspects: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, known: _Optional[bool] = ..., plan_epoch: _Optional[int] = ..., subspace_version: _Optional[int] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., run_complete: _Optional[bool] = ..., cut_requests: _Optional[int] = ..., session: _Optional[str] = ..., keep_orders: _Optional[int] = ..., keep: _Optional[_Iterable[_Union[StageCheckpoint, _Mapping]]] = ..., audit_suspects: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckpointReport(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "checkpoint", "kept", "bad_holder")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    BAD_HOLDER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    checkpoint: StageCheckpoint
    kept: bool
    bad_holder: str
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., checkpoint: _Optional[_Union[StageCheckpoint, _Mapping]] = ..., kept: _Optional[bool] = ..., bad_holder: _Optional[str] = ...) -> None: ...

class CheckpointAck(_message.Message):
    __slots__ = ("latest_cut",)
    LATEST_CUT_FIELD_NUMBER: _ClassVar[int]
    latest_cut: int
    def __init__(self, latest_cut: _Optional[int] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "reason", "peer_node_id", "bad_input")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    reason: str
    peer_node_id: str
    bad_input: bool
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., reason: _Optional[str] = ..., peer_node_id: _Optional[str] = ..., bad_input: _Optional[bool] = ...) -> None: ...

class FailureAck(_message.Message):
    __slots__ = ("plan_epoch",)
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    plan_epoch: int
    def __init__(self, plan_epoch: _Optional[int] = ...) -> None: ...

class CutRequest(_message.Message):
    __slots__ = ("node_id", "plan_epoch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ...) -> None: ...

class CutAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AuditReport(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "stage", "step", "microbatch", "audited_node_id", "outcome", "direction", "rel_l2", "cosine", "detail")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    AUDITED_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    REL_L2_FIELD_NUMBER: _ClassVar[int]
    COSINE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    stage: int
    step: int
    microbatch: int
    audited_node_id: str
    outcome: str
    direction: str
    rel_l2: float
    cosine: float
    detail: str
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., audited_node_id: _Optional[str] = ..., outcome: _Optional[str] = ..., direction: _Optional[str] = ..., rel_l2: _Optional[float] = ..., cosine: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class AuditAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("held", "complete")
    HELD_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    held: int
    complete: bool
    def __init__(self, held: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class ArtifactStatusReply(_message.Message):
    __slots__ = ("held", "complete")
    HELD_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    held: int
    complete: bool
    def __init__(self, held: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunConfigReply(_message.Message):
    __slots__ = ("run_id", "config_json", "config_hash")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_json: str
    config_hash: str
    def __init__(self, run_id: _Optional[str] = ..., config_json: _Optional[str] = ..., config_hash: _Optional[str] = ...) -> None: ...

class ArtifactRequest(_message.Message):
    __slots__ = ("digest", "offset", "node_id")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    digest: str
    offset: int
    node_id: str
    def __init__(self, digest: _Optional[str] = ..., offset: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class ArtifactChunk(_message.Message):
    __slots__ = ("node_id", "offset", "data", "total_size", "digest")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    offset: int
    data: bytes
    total_size: int
    digest: str
    def __init__(self, node_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class WatchRotationsRequest(_message.Message):
    __slots__ = ("node_id", "after_version", "lineage")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    after_version: int
    lineage: int
    def __init__(self, node_id: _Optional[str] = ..., after_version: _Optional[int] = ..., lineage: _Optional[int] = ...) -> None: ...

class StatisticsReport(_message.Message):
    __slots__ = ("node_id", "stage", "step", "boundary", "subspace_version", "gram_times_basis_f64_le", "off_energy", "total_energy", "rows", "plan_epoch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    SUBSPACE_VERSION_FIELD_NUMBER: _ClassVar[int]
    GRAM_TIMES_BASIS_F64_LE_FIELD_NUMBER: _ClassVar[int]
    OFF_ENERGY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ENERGY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    stage: int
    step: int
    boundary: int
    subspace_version: int
    gram_times_basis_f64_le: bytes
    off_energy: float
    total_energy: float
    rows: int
    plan_epoch: int
    def __init__(self, node_id: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., boundary: _Optional[int] = ..., subspace_version: _Optional[int] = ..., gram_times_basis_f64_le: _Optional[bytes] = ..., off_energy: _Optional[float] = ..., total_energy: _Optional[float] = ..., rows: _Optional[int] = ..., plan_epoch: _Optional[int] = ...) -> None: ...

class StatisticsAck(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("plan_epoch", "node_id", "stage", "step", "loss", "tokens", "bytes_sent_forward", "bytes_sent_backward", "wall_seconds", "progress_only", "drifted_frames", "drift", "tallies")
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FORWARD_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_ONLY_FIELD_NUMBER: _ClassVar[int]
    DRIFTED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    TALLIES_FIELD_NUMBER: _ClassVar[int]
    plan_epoch: int
    node_id: str
    stage: int
    step: int
    loss: float
    tokens: int
    bytes_sent_forward: int
    bytes_sent_backward: int
    wall_seconds: float
    progress_only: bool
    drifted_frames: int
    drift: str
    tallies: _containers.RepeatedCompositeFieldContainer[FrameTally]
    def __init__(self, plan_epoch: _Optional[int] = ..., node_id: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., bytes_sent_forward: _Optional[int] = ..., bytes_sent_backward: _Optional[int] = ..., wall_seconds: _Optional[float] = ..., progress_only: _Optional[bool] = ..., drifted_frames: _Optional[int] = ..., drift: _Optional[str] = ..., tallies: _Optional[_Iterable[_Union[FrameTally, _Mapping]]] = ...) -> None: ...

class FrameTally(_message.Message):
    __slots__ = ("boundary", "direction", "sent", "received", "sent_frames", "received_frames")
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SENT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    boundary: int
    direction: str
    sent: bytes
    received: bytes
    sent_frames: int
    received_frames: int
    def __init__(self, boundary: _Optional[int] = ..., direction: _Optional[str] = ..., sent: _Optional[bytes] = ..., received: _Optional[bytes] = ..., sent_frames: _Optional[int] = ..., received_frames: _Optional[int] = ...) -> None: ...

class StepAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("since_step",)
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    since_step: int
    def __init__(self, since_step: _Optional[int] = ...) -> None: ...

class StepSummary(_message.Message):
    __slots__ = ("step", "loss", "tokens", "bytes_sent_forward", "bytes_sent_backward", "wall_seconds", "completed_at")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FORWARD_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    tokens: int
    bytes_sent_forward: int
    bytes_sent_backward: int
    wall_seconds: float
    completed_at: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., bytes_sent_forward: _Optional[int] = ..., bytes_sent_backward: _Optional[int] = ..., wall_seconds: _Optional[float] = ..., completed_at: _Optional[float] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "node_name", "address", "stages", "last_heartbeat_age_s", "alive", "device", "phase", "plan_epoch", "step", "tokens_per_second", "subspace_version", "left", "last_stages", "reachable", "drifted_frames")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SUBSPACE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    LAST_STAGES_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DRIFTED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_name: str
    address: str
    stages: _containers.RepeatedScalarFieldContainer[int]
    last_heartbeat_age_s: float
    alive: bool
    device: str
    phase: NodePhase
    plan_epoch: int
    step: int
    tokens_per_second: float
    subspace_version: int
    left: bool
    last_stages: _containers.RepeatedScalarFieldContainer[int]
    reachable: bool
    drifted_frames: int
    def __init__(self, node_id: _Optional[str] = ..., node_name: _Optional[str] = ..., address: _Optional[str] = ..., stages: _Optional[_Iterable[int]] = ..., last_heartbeat_age_s: _Optional[float] = ..., alive: _Optional[bool] = ..., device: _Optional[str] = ..., phase: _Optional[_Union[NodePhase, str]] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., subspace_version: _Optional[int] = ..., left: _Optional[bool] = ..., last_stages: _Optional[_Iterable[int]] = ..., reachable: _Optional[bool] = ..., drifted_frames: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run_id", "step", "subspace_version", "nodes", "config_hash", "steps_completed", "steps", "plan_epoch", "resume_step", "latest_cut", "run_complete", "epochs_restarted", "rates", "plan_problems", "relayed_links", "snapshot_holding", "bad_holders", "rebuilt_stages", "commitment_checks", "commitment_mismatches", "audits_matched", "audits_mismatched", "audits_unavailable", "audit_lines")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SUBSPACE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_CUT_FIELD_NUMBER: _ClassVar[int]
    RUN_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_RESTARTED_FIELD_NUMBER: _ClassVar[int]
    RATES_FIELD_NUMBER: _ClassVar[int]
    PLAN_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_LINKS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_HOLDING_FIELD_NUMBER: _ClassVar[int]
    BAD_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    REBUILT_STAGES_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_CHECKS_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    AUDITS_MATCHED_FIELD_NUMBER: _ClassVar[int]
    AUDITS_MISMATCHED_FIELD_NUMBER: _ClassVar[int]
    AUDITS_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    AUDIT_LINES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    subspace_version: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    config_hash: str
    steps_completed: int
    steps: _containers.RepeatedCompositeFieldContainer[StepSummary]
    plan_epoch: int
    resume_step: int
    latest_cut: int
    run_complete: bool
    epochs_restarted: int
    rates: RunRates
    plan_problems: _containers.RepeatedScalarFieldContainer[str]
    relayed_links: _containers.RepeatedScalarFieldContainer[str]
    snapshot_holding: str
    bad_holders: _containers.RepeatedScalarFieldContainer[str]
    rebuilt_stages: _containers.RepeatedScalarFieldContainer[str]
    commitment_checks: int
    commitment_mismatches: _containers.RepeatedScalarFieldContainer[str]
    audits_matched: int
    audits_mismatched: int
    audits_unavailable: int
    audit_lines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., subspace_version: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., config_hash: _Optional[str] = ..., steps_completed: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepSummary, _Mapping]]] = ..., plan_epoch: _Optional[int] = ..., resume_step: _Optional[int] = ..., latest_cut: _Optional[int] = ..., run_complete: _Optional[bool] = ..., epochs_restarted: _Optional[int] = ..., rates: _Optional[_Union[RunRates, _Mapping]] = ..., plan_problems: _Optional[_Iterable[str]] = ..., relayed_links: _Optional[_Iterable[str]] = ..., snapshot_holding: _Optional[str] = ..., bad_holders: _Optional[_Iterable[str]] = ..., rebuilt_stages: _Optional[_Iterable[str]] = ..., commitment_checks: _Optional[int] = ..., commitment_mismatches: _Optional[_Iterable[str]] = ..., audits_matched: _Optional[int] = ..., audits_mismatched: _Optional[int] = ..., audits_unavailable: _Optional[int] = ..., audit_lines: _Optional[_Iterable[str]] = ...) -> None: ...

class RunRates(_message.Message):
    __slots__ = ("steps", "loss", "tokens_per_second", "bytes_per_token", "compression_ratio")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    steps: int
    loss: float
    tokens_per_second: float
    bytes_per_token: float
    compression_ratio: float
    def __init__(self, steps: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., bytes_per_token: _Optional[float] = ..., compression_ratio: _Optional[float] = ...) -> None: ...
