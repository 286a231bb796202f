# Sourced by bench/gpu_check.sh and bench/gpu_scaling.sh (from the checkout's root, with $py set):
# installs the carried wheels (.whl/, from `make gpu-wheels`) and this checkout, editable and without
# dependencies, into $py; GPU_CHECK_INSTALL=0 skips it.
if [ "${GPU_CHECK_INSTALL:-1}" = "1" ]; then
  [ -d .whl ] || { echo "no .whl/: run 'make gpu-wheels' here and carry .whl" >&2; exit 2; }
  "$py" -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl || exit 3
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 3
fi
