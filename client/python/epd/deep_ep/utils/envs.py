"""Process-group set-up for DeepEP-style test scripts running on epd.

init_dist starts torch.distributed the way DeepEP's tests expect, and also works where
several ranks share one GPU (or there is no GPU): it then uses gloo, since NCCL refuses
two ranks on one device. docs/DEEP_EP.md "init_dist" has the details.
"""

import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["dist_print", "init_dist", "install_gloo_all_gather_shim"]

_local_rank: Optional[int] = None


def _backend_of(group) -> str:
    return str(dist.get_backend(group)).lower()


def install_gloo_all_gather_shim() -> None:
    """Makes torch.distributed.all_gather_into_tensor accept, on gloo groups, the output
    shapes NCCL accepts: [R, *in.shape] and [R * in.shape[0], *in.shape[1:]].

    gloo's own all_gather_into_tensor refuses the stacked [R, ...] form (and older torch
    has none for gloo); the shim gathers into R views of the output with all_gather.
    Other backends, and async_op=True, go to the original function. Idempotent.
    """
    original = getattr(dist, "all_gather_into_tensor", None)
    if original is not None and getattr(original, "_epd_gloo_shim", False):
        return

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if async_op or _backend_of(group) != "gloo":
            if original is None:
                raise RuntimeError("torch.distributed.all_gather_into_tensor is unavailable")
            return original(output_tensor, input_tensor, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        if tuple(output_tensor.shape) == (world,) + tuple(input_tensor.shape):
            parts = list(output_tensor.unbind(0))
        elif output_tensor.dim() >= 1 and output_tensor.size(0) == world * max(input_tensor.size(0), 0) \
                and tuple(output_tensor.shape[1:]) == tuple(input_tensor.shape[1:]):
            parts = list(output_tensor.chunk(world, dim=0))
        else:
            raise ValueError(
                f"all_gather_into_tensor: output shape {tuple(output_tensor.shape)} fits neither "
                f"[{world}, *{tuple(input_tensor.shape)}] nor [{world} * {input_tensor.shape[0]}, ...]")
        if all(p.is_contiguous() for p in parts):
            dist.all_gather(parts, input_tensor.contiguous(), group=group)
        else:
            gathered = [torch.empty_like(input_tensor) for _ in range(world)]
            dist.all_gather(gathered, input_tensor.contiguous(), group=group)
            for p, g in zip(parts, gathered):
                p.copy_(g)
        return None

    all_gather_into_tensor._epd_gloo_shim = True
    dist.all_gather_into_tensor = all_gather_into_tensor


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> Tuple[int, int, dist.ProcessGroup]:
    """Starts torch.distributed for local rank `local_rank` of `num_local_ranks` per node.

    Environment: MASTER_ADDR (default 127.0.0.1), MASTER_PORT (8361), WORLD_SIZE (nodes,
    1), RANK (node rank, 0). With CUDA: device local_rank % device_count, default device
    'cuda'. Backend NCCL when every local rank has a GPU of its own, else gloo (with
    install_gloo_all_gather_shim); EPD_DIST_BACKEND overrides. Sets the default dtype to
    bfloat16 and seeds torch with seed + rank.

    Returns (rank, world_size, a group of every rank).
    """
    global _local_rank
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", "1"))
    node_rank = int(os.getenv("RANK", "0"))
    _local_rank = local_rank

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    own_gpu = cuda and torch.cuda.device_count() >= num_local_ranks
    backend = os.getenv("EPD_DIST_BACKEND", "nccl" if own_gpu else "gloo")
    dist.init_process_group(backend=backend, init_method=f"tcp://{ip}:{port}",
                            world_size=num_nodes * num_local_ranks,
                            rank=node_rank * num_local_ranks + local_rank)
    if backend == "gloo":
        install_gloo_all_gather_shim()
    torch.set_default_dtype(torch.bfloat16)
    if cuda and hasattr(torch, "set_default_device"):
        torch.set_default_device("cuda")
    torch.manual_seed(seed + dist.get_rank())
    world = dist.get_world_size()
    return dist.get_rank(), world, dist.new_group(list(range(world)))


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Prints s on every rank (or local rank 0 only), then a barrier."""
    if not once_in_node or _local_rank in (None, 0):
        print(s, flush=True)
    dist.barrier()
