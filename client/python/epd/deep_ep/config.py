"""Config: DeepEP's tuning record for normal-mode kernels, kept for API compatibility.

epd's kernels take only an SM budget (num_sms); the chunk sizes are recorded and not used.
The size hints are epd's: see get_nvl_buffer_size_hint.
"""

from . import _sizes

__all__ = ["Config"]

# Tokens per rank the NVL size hint provisions for.
HINT_TOKENS_PER_RANK = 4096


class Config:
    """Normal-mode tuning: num_sms is passed to epd's kernels; the chunk sizes are kept
    for callers that read them back."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms,
                      num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Config: {name} = {value!r} must be an int >= 0")
        self.__dict__.update(values)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of num_nvl_bytes that let epd's normal mode carry up to 4096 bf16 tokens
        per rank of hidden_bytes / 2 channels with top-k up to max(8, num_ranks) among
        32 experts per rank. Give more for more tokens (the Buffer's error names the bytes
        an op needs)."""
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError(f"hidden_bytes {hidden_bytes} and num_ranks {num_ranks} must be > 0")
        hidden = max(1, hidden_bytes // 2)
        return _sizes.endpoint_bytes(num_ranks=num_ranks, num_experts=32 * num_ranks,
                                     hidden=hidden, num_topk=max(8, num_ranks),
                                     max_tokens_per_rank=HINT_TOKENS_PER_RANK,
                                     ll_max_tokens_per_rank=0, use_fp8=hidden % 128 == 0)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: epd's normal mode uses no RDMA buffer (internode is not supported)."""
        return 0

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")
