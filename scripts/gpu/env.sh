# Source on the GPU machine from the repository root after ../shared/gpu/pack and
# copying the wheel (maturin build --release --locked -o /tmp/wheels) to .gpu/wheels/:
#   source scripts/gpu/env.sh
# Installs the wheel on PYTHONPATH, sets VMMBUF_REQUIRE_GPU=1 and NCCL_NVLS_ENABLE=0,
# and puts PyTorch's libnccl on LD_LIBRARY_PATH as libnccl.so (the name cudarc's
# loader looks for), for tests/all/nccl.rs and benches/nccl.rs.
# Installed once per wheel: a second source (a parallel job's) finds the
# same wheel's stamp and leaves the installed copy to the jobs using it.
P=/tmp/pk; W=$(cat .gpu/wheels/*.whl 2>/dev/null | md5sum | cut -c1-32)
if [ "$(cat "$P/.wheel" 2>/dev/null)" != "$W" ]; then
  rm -rf "$P"; pip install -q --no-index --target "$P" .gpu/wheels/*.whl 2>/dev/null && echo "$W" > "$P/.wheel"
fi
export PYTHONPATH=$P VMMBUF_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
NL=$(find $(python -c "import site;print(' '.join(site.getsitepackages()))") -name 'libnccl.so*' 2>/dev/null | head -1)
echo "libnccl: ${NL:-not found}"
mkdir -p /tmp/ncl && ln -sf "$NL" /tmp/ncl/libnccl.so && export LD_LIBRARY_PATH=/tmp/ncl:${LD_LIBRARY_PATH:-}
