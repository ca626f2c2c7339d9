"""The forward batch: what one model step tells the attention layer, as a pytree with static buckets.

SGLang's ForwardBatch is a mutable object with CPU copies of lengths; here it is a frozen pytree whose
array shapes are fixed by padded buckets (max batch B, token count T), so one compiled step serves every
batch that fits the buckets: no host sync, no retrace.

Token layout: the new tokens of sequence b are rows ``qo_indptr[b]:qo_indptr[b+1]`` of q/k/v (extend,
verify), with padding tokens after the last real one. In DECODE mode token b always belongs to sequence b.
Padding sequences have ``seq_lens == 0`` and their tokens write to slot 0 (the padding slot) and produce
zeros.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from jaxattn.checks import INDEX_DTYPES, MASK_DTYPES, MAX_DECODE_QUERY_TOKENS, check_array, index_i32
from jaxattn.kv_indices import exclusive_cumsum
from jaxattn.metadata import custom_mask_from_draft_bits, custom_mask_indptr


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill with a cached prefix (also plain prefill: prefix 0)
    DECODE = "decode"  # one new token per sequence
    TARGET_VERIFY = "target_verify"  # speculative: draft tokens of a tree verified under a custom mask
    DRAFT_EXTEND = "draft_extend"  # speculative: the draft model extends over the accepted tokens (causal)
    IDLE = "idle"  # no tokens (a data-parallel rank with nothing to do)

    @property
    def is_extend_like(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """One step's batch. Array fields are traced; `mode` and the buckets are static (part of the jit key)."""

    req_pool_indices: jax.Array  # i32[B]: each sequence's row of req_to_token
    seq_lens: jax.Array  # i32[B]: tokens of each sequence including this step's new ones (0 = padding row)
    extend_lens: jax.Array  # i32[B]: new tokens of each sequence this step (decode: 1, padding: 0)
    out_cache_loc: jax.Array  # i32[T]: KV-pool slot each new token is written to (padding tokens: 0)
    positions: jax.Array  # i32[T]: position of each new token in its sequence
    encoder_lens: jax.Array | None = None  # i32[B]: encoder tokens stored before the decoder's (cross attention)
    custom_mask: jax.Array | None = None  # bool[mask_capacity]: TARGET_VERIFY tree mask, per sequence [D, seq_len]
    # i32[B, D]: TARGET_VERIFY's tree as per-row bit masks instead (bit j of [b, t]: draft t sees draft j; every draft
    # sees the prefix). Every sequence then has D drafts at token rows b * D .. b * D + D - 1 (T = B * D; padding
    # sequences after the real ones, extend_len 0, their rows write slot 0), and full layers run the several-token decode kernel
    # (no [D, seq_len] mask through memory). `draft_mask_bits` packs a boolean [D, D] tree mask.
    draft_mask: jax.Array | None = None
    mode: ForwardMode = dataclasses.field(default=ForwardMode.EXTEND, metadata=dict(static=True))
    max_extend_len: int = dataclasses.field(default=1, metadata=dict(static=True))  # bucket: max new tokens per sequence
    kv_capacity: int = dataclasses.field(default=1, metadata=dict(static=True))  # bucket: max total listed keys
    max_seq_len: int = dataclasses.field(default=1, metadata=dict(static=True))  # bucket: max keys of one sequence

    def __post_init__(self):
        if not isinstance(self.mode, ForwardMode):
            raise ValueError(f"mode must be a ForwardMode; got {self.mode!r}")
        for name in ("max_extend_len", "kv_capacity", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int (a static bucket); got {value!r}")
        for name in ("req_pool_indices", "seq_lens", "extend_lens", "out_cache_loc", "positions", "encoder_lens",
                     "custom_mask", "draft_mask"):
            # Lists would skip every shape check below (which only arrays, tracers and shape structs go through).
            if isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"ForwardBatch.{name} must be an array (e.g. jnp.asarray(..., jnp.int32)); got a "
                                f"{type(getattr(self, name)).__name__}")
        if isinstance(self.seq_lens, jax.Array) or hasattr(self.seq_lens, "shape"):
            check_array("req_pool_indices", self.req_pool_indices, ndim=1, dtypes=INDEX_DTYPES, what="[batch]")
            batch = self.req_pool_indices.shape[0]
            for name in ("seq_lens", "extend_lens"):
                check_array(name, getattr(self, name), shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
            check_array("out_cache_loc", self.out_cache_loc, ndim=1, dtypes=INDEX_DTYPES, what="[tokens]")
            check_array("positions", self.positions, shape=self.out_cache_loc.shape, dtypes=INDEX_DTYPES, what="[tokens]")
            if self.encoder_lens is not None:
                check_array("encoder_lens", self.encoder_lens, shape=(batch,), dtypes=INDEX_DTYPES, what="[batch]")
            if self.mode == ForwardMode.DECODE and self.out_cache_loc.shape[0] != batch:
                raise ValueError(
                    f"in DECODE mode token b is sequence b: out_cache_loc must have shape ({batch},); got {self.out_cache_loc.shape}"
                )
            if self.mode == ForwardMode.TARGET_VERIFY and (self.custom_mask is None) == (self.draft_mask is None):
                raise ValueError("TARGET_VERIFY needs custom_mask (the tree mask, per sequence row-major [draft, seq_len]) "
                                 "or draft_mask (i32[batch, drafts] bit masks), one of them")
            if self.custom_mask is not None:
                if self.mode != ForwardMode.TARGET_VERIFY:
                    raise ValueError(f"custom_mask is a TARGET_VERIFY field; the batch's mode is {self.mode.name}")
                check_array("custom_mask", self.custom_mask, ndim=1, dtypes=MASK_DTYPES,
                            what="[mask_capacity] (per sequence row-major [draft, seq_len])")
            if self.draft_mask is not None:
                if self.mode != ForwardMode.TARGET_VERIFY:
                    raise ValueError(f"draft_mask is a TARGET_VERIFY field; the batch's mode is {self.mode.name}")
                check_array("draft_mask", self.draft_mask, ndim=2, dtypes=(jnp.int32, jnp.uint32), what="[batch, drafts]")
                drafts = self.draft_mask.shape[1]
                if self.draft_mask.shape[0] != batch or not 1 <= drafts <= MAX_DECODE_QUERY_TOKENS:
                    raise ValueError(f"draft_mask must have shape ({batch}, D) with 1 <= D <= {MAX_DECODE_QUERY_TOKENS}; "
                                     f"got {tuple(self.draft_mask.shape)}")
                if self.out_cache_loc.shape[0] != batch * drafts:
                    raise ValueError(f"with draft_mask every sequence has {drafts} token rows: out_cache_loc must have "
                                     f"shape ({batch * drafts},); got {tuple(self.out_cache_loc.shape)}")

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.shape[0]

    @property
    def prefix_lens(self) -> jax.Array:
        """i32[B]: tokens already in the cache before this step."""
        return jnp.maximum(self.seq_lens - self.extend_lens, 0)

    @property
    def qo_indptr(self) -> jax.Array:
        """i32[B + 1]: where each sequence's new tokens sit among the step's tokens."""
        if self.mode == ForwardMode.DECODE:
            return jnp.arange(self.batch_size + 1, dtype=jnp.int32)
        if self.draft_mask is not None:  # D rows per sequence, padding sequences included
            return jnp.arange(self.batch_size + 1, dtype=jnp.int32) * self.draft_mask.shape[1]
        return exclusive_cumsum(self.extend_lens)

    @property
    def mask_indptr(self) -> jax.Array:
        """i32/i64[B + 1] (`jaxattn.metadata.custom_mask_indptr`): start of each sequence's [extend_len, seq_len] block."""
        return custom_mask_indptr(self.extend_lens, self.seq_lens)

    def verify_custom_mask(self) -> jax.Array:
        """TARGET_VERIFY's boolean tree mask: `custom_mask`, or `draft_mask` expanded to that form (bool[B * D *
        max_seq_len]) for the paths that read it whole."""
        if self.custom_mask is not None:
            return self.custom_mask
        batch, drafts = self.draft_mask.shape
        return custom_mask_from_draft_bits(self.draft_mask, self.extend_lens, self.seq_lens,
                                           batch * drafts * self.max_seq_len)

    def verify_draft_words(self) -> jax.Array:
        """TARGET_VERIFY's tree as `extend_attention(draft_mask=)` takes it: i32[B * D, 1], row b * D + t holding
        `draft_mask[b, t]` with the bits of drafts past the sequence's extend_len cleared (a padding sequence's rows
        see nothing, as in the expanded mask)."""
        batch, drafts = self.draft_mask.shape
        words = jax.lax.bitcast_convert_type(self.draft_mask, jnp.uint32) if self.draft_mask.dtype == jnp.int32 \
            else self.draft_mask
        listed = jnp.clip(index_i32(self.extend_lens), 0, 32).astype(jnp.uint32)
        keep = jnp.where(listed >= 32, jnp.uint32(0xFFFFFFFF), (jnp.uint32(1) << listed) - 1)
        return jax.lax.bitcast_convert_type(words & keep[:, None], jnp.int32).reshape(batch * drafts, 1)


def tree_mask_for_verify(parents, prefix_len: int):
    """Builds the TARGET_VERIFY mask rows of one sequence from a draft tree (host helper, numpy).

    Args:
      parents: length-D list; parents[i] is the index of draft token i's parent, or -1 for a root that
        follows the verified prefix directly. Tokens are in topological order (parent before child).
      prefix_len: tokens of the sequence before the drafts.

    Returns:
      bool[D, prefix_len + D]: row i sees the whole prefix, itself and its ancestors.
    """
    import numpy as np

    draft = len(parents)
    mask = np.zeros((draft, prefix_len + draft), bool)
    mask[:, :prefix_len] = True
    for i in range(draft):
        j = i
        while j >= 0:
            mask[i, prefix_len + j] = True
            j = parents[j]
    return mask
