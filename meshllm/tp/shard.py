"""Which slice of every weight one rank of a tensor-parallel group holds (pure arithmetic).

Megatron-style split of a Llama layer over `size` ranks:

- q/k/v and gate/up are column-parallel: each rank holds whole attention heads (rows of
  q_proj), their KV heads (rows of k_proj, v_proj) and a slice of the MLP's rows, and
  computes its heads' attention against its own KV cache;
- o_proj and down_proj are row-parallel: each rank multiplies its columns and one
  all-reduce per projection sums the partial outputs (two per layer);
- the embedding and LM head are split by vocabulary rows: a lookup all-reduces the one
  rank's row, the head's logits are gathered on rank 0, which alone samples.

KV heads are replicated when there are fewer than ranks (each rank keeps the one its
query heads attend to); counts that cannot be split evenly are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshllm.errors import TensorParallelUnsplittable
from meshllm.model.config import ModelConfig
from meshllm.model.tensor_slice import TensorSlice


def check_splittable(config: ModelConfig, size: int) -> None:
    """Raise TensorParallelUnsplittable naming the counts when `config` cannot be split `size` ways."""
    if size < 1:
        raise TensorParallelUnsplittable(f"tensor-parallel size must be at least 1, got {size}")
    if size == 1:
        return
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads do not divide by {size}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"its {kv_heads} KV heads neither divide by {size} nor divide {size} "
                        f"(replicating KV heads needs a group size that is a multiple of them)")
    if inter % size:
        problems.append(f"its MLP width (intermediate_size {inter}) does not divide by {size}")
    if config.vocab_size < size:
        problems.append(f"its vocabulary of {config.vocab_size} is smaller than the group")
    if config.num_experts:
        problems.append("its mixture-of-experts layers are not split across a group (they run in pipeline stages)")
    if problems:
        ways = [n for n in range(2, heads + 1) if _splits(config, n)]
        hint = (f"group sizes that split it: {', '.join(map(str, ways))}" if ways
                else "no group size above 1 splits it; run it without tensor parallelism")
        raise TensorParallelUnsplittable(
            f"{config.model_type} model cannot be split over a tensor-parallel group of {size}: "
            f"{'; '.join(problems)}. {hint[0].upper()}{hint[1:]}.")


def _splits(config: ModelConfig, size: int) -> bool:
    kv = config.num_key_value_heads
    return (config.num_attention_heads % size == 0 and (kv % size == 0 or size % kv == 0)
            and config.intermediate_size % size == 0 and config.vocab_size >= size and not config.num_experts)


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The slices rank `rank` of a `size`-way group holds; build with `ShardLayout.of`."""

    config: ModelConfig  # the whole model's
    rank: int
    size: int
    q_heads: range  # global query head indices this rank computes
    kv_heads: range  # global KV head indices it keeps (shared with other ranks when replicated)
    mlp_rows: range  # rows of gate/up, columns of down
    vocab_rows: range  # rows of the embedding and the LM head

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> ShardLayout:
        check_splittable(config, size)
        if not 0 <= rank < size:
            raise TensorParallelUnsplittable(f"rank {rank} is outside a group of {size}")
        heads, kv = config.num_attention_heads // size, config.num_key_value_heads
        q_heads = range(rank * heads, (rank + 1) * heads)
        if kv >= size:
            per_rank = kv // size
            kv_heads = range(rank * per_rank, (rank + 1) * per_rank)
        else:
            # Fewer KV heads than ranks: `size // kv` consecutive ranks share one KV head, the one
            # their query heads attend to (query head j reads KV head j // (heads per KV head)).
            shared = rank // (size // kv)
            kv_heads = range(shared, shared + 1)
        mlp = config.intermediate_size // size
        per_vocab = -(-config.vocab_size // size)  # ceil: the last rank may hold fewer rows
        vocab_rows = range(min(rank * per_vocab, config.vocab_size), min((rank + 1) * per_vocab, config.vocab_size))
        if not vocab_rows:
            raise TensorParallelUnsplittable(f"a vocabulary of {config.vocab_size} leaves rank {rank} of {size} "
                                             f"no rows; use a smaller group")
        return cls(config, rank, size, q_heads, kv_heads, range(rank * mlp, (rank + 1) * mlp), vocab_rows)

    @property
    def vocab_rows_per_rank(self) -> int:
        """Rows every rank's logits are padded to, so rank 0 can gather equal-sized pieces."""
        return -(-self.config.vocab_size // self.size)

    def local_config(self) -> ModelConfig:
        """The config of this rank's slice: a single-device Decoder built from it has exactly its shapes."""
        return replace(self.config, num_attention_heads=len(self.q_heads), num_key_value_heads=len(self.kv_heads),
                       intermediate_size=len(self.mlp_rows), vocab_size=len(self.vocab_rows))

    def slice_of(self, hf_name: str) -> TensorSlice | None:
        """This rank's slice of a Hugging Face tensor; None when every rank holds all of it."""
        d = self.config.head_dim
        q = TensorSlice(0, self.q_heads.start * d, self.q_heads.stop * d)
        kv = TensorSlice(0, self.kv_heads.start * d, self.kv_heads.stop * d)
        rows = {".q_proj.": q, ".k_proj.": kv, ".v_proj.": kv,
                ".gate_proj.": TensorSlice(0, self.mlp_rows.start, self.mlp_rows.stop),
                ".up_proj.": TensorSlice(0, self.mlp_rows.start, self.mlp_rows.stop)}
        for part, s in rows.items():
            if part in hf_name:  # weight and bias alike: both are sliced by output rows
                return s
        if ".o_proj.weight" in hf_name:
            return TensorSlice(1, q.start, q.stop)
        if ".down_proj.weight" in hf_name:
            return TensorSlice(1, self.mlp_rows.start, self.mlp_rows.stop)
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return TensorSlice(0, self.vocab_rows.start, self.vocab_rows.stop)
        return None  # norms (per hidden unit or per head dim): every rank needs all of them
