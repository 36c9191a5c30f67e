#!/usr/bin/env bash
# Lint for the rule "no copy engine on the op path" (docs/CUDA_BACKEND.md): what the host
# reads back after an op (status, recv_count, ready_seen) is written by a kernel into
# host-mapped pinned memory, never copied device-to-host, because a copy queues on a
# copy-engine queue shared by the process's streams and can wait there behind a stream
# that waits on the GPU. Fails listing every device-to-host copy in the scanned op-path
# sources. A copy toward the device (the client's staging of inputs a kernel cannot read)
# says so on the matching line with the marker below. Usage: no_copy_engine_on_op_path.sh
# REPO_ROOT
set -euo pipefail
root="${1:?usage: $0 REPO_ROOT}"
cd "$root"
# Op-path sources: the daemon, the CUDA kernels' launchers and the client library.
scan=(daemon kernels/cuda client)
# Documented synchronous CPU-sync APIs (not on the op path): ReadAndClearStatus,
# ReadNormalDispatchCounts.
allowed=(kernels/cuda/status.cu kernels/cuda/normal_host.cu)
# Not the op path: the client's example programs (they print results).
allowed_dirs=(client/examples/)
# A host-to-device or peer copy whose kind is cudaMemcpyDefault carries this on its line.
marker='// copy-engine-lint: to the device'

pattern='cudaMemcpyDeviceToHost|cudaMemcpyDefault|cudaMemcpyDtoH|cuMemcpyDtoH'
found=0
while IFS= read -r hit; do
  file="${hit%%:*}"
  skip=0
  for a in "${allowed[@]}"; do [[ "$file" == "$a" ]] && skip=1; done
  for d in "${allowed_dirs[@]}"; do [[ "$file" == "$d"* ]] && skip=1; done
  line="${hit#*:*:}"
  [[ "$line" == *"$marker"* ]] && skip=1
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
