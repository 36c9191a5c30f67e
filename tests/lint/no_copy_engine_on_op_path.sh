#!/usr/bin/env bash
# Lint for the rule "no copy engine on the op path" (docs/CUDA_BACKEND.md): what the host
# reads back after an op (status, recv_count, ready_seen) is written by a kernel into
# host-mapped pinned memory, never copied device-to-host, because a copy queues on a
# copy-engine queue shared by the process's streams and can wait there behind a stream
# that waits on the GPU. Fails listing every device-to-host copy in the scanned op-path
# sources. Usage: no_copy_engine_on_op_path.sh REPO_ROOT
set -euo pipefail
root="${1:?usage: $0 REPO_ROOT}"
cd "$root"
# Op-path sources: the daemon, and the CUDA kernels' launchers. The client's op path
# (client/endpoint/) joins this list once it passes NormalDispatchArgs::recv_count_out.
scan=(daemon kernels/cuda)
# Documented synchronous CPU-sync APIs (not on the op path): ReadAndClearStatus,
# ReadNormalDispatchCounts.
allowed=(kernels/cuda/status.cu kernels/cuda/normal_host.cu)
pattern='cudaMemcpyDeviceToHost|cudaMemcpyDefault|cudaMemcpyDtoH|cuMemcpyDtoH'
found=0
while IFS= read -r hit; do
  file="${hit%%:*}"
  skip=0
  for a in "${allowed[@]}"; do [[ "$file" == "$a" ]] && skip=1; done
  line="${hit#*:*:}"
  # Comments may name the call.
  [[ "$line" =~ ^[[:space:]]*// ]] && skip=1
  if [[ $skip == 0 ]]; then
    echo "device-to-host copy on the op path: $hit" >&2
    found=1
  fi
done < <(grep -rnE "$pattern" "${scan[@]}" --include='*.cc' --include='*.cu' --include='*.h' \
           --include='*.cuh' || true)
if [[ $found != 0 ]]; then
  echo "write the value from a kernel into host-mapped pinned memory instead" >&2
  echo "(e.g. NormalDispatchArgs::recv_count_out, EnqueueStatusReadback)" >&2
  exit 1
fi
echo "no device-to-host copy on the op path in: ${scan[*]}"
