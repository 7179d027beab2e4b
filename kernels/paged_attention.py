"""paged_attention over the paged KV cache, plain torch: the CPU path and the Triton reference.

Varlen queries (decodes and prefill chunks mixed in one call), causal, grouped-query heads,
optionally a sliding window, a logit soft-cap (Gemma 2) and attention sinks (gpt-oss: a learned
logit per head that joins each softmax's denominator and carries no value). All one-token
queries (decodes) run
as padded batches, so a step costs a handful of torch calls per layer rather than one per
sequence; multi-token chunks run one sequence at a time. With a window only the blocks that
hold visible keys are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_KV_HEADS_BLOCK_DIAGONAL = 8
"""Up to this many KV heads decodes use `_block_diagonal` (whose FLOPs grow with KV heads)."""


DECODE_GROUP_BYTES = 2 << 20
"""Gathered K+V per decode group: small enough to stay in a server CPU's last-level cache."""


class Workspace:
    """Reusable scratch buffers (the gathered K/V of a decode batch), grown on demand.

    A big fresh tensor per layer costs page faults on every step (glibc serves allocations over
    32 MiB with mmap); the runner keeps one Workspace and passes it to every layer's call.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        buf = self._buffers.get(name)
        if (buf is None or buf.numel() < numel or buf.dtype != like.dtype
                or buf.device != like.device):
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    window: int | None = None,
    workspace: Workspace | None = None,
    max_group_bytes: int = DECODE_GROUP_BYTES,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`window` (None = full attention): a query at position p sees the keys at positions
    (p - window, p], transformers' sliding-window convention (Mistral, Qwen2).
    `softcap` (None = off): each scaled score s becomes softcap * tanh(s / softcap) before the
    mask and softmax (Gemma 2's attn_logit_softcapping); SDPA cannot, so those calls run the
    explicit matmul-softmax-matmul.
    `sinks` (None = off): [num_heads] logits, one per query head (gpt-oss): each softmax runs
    over the visible keys' scores plus the head's sink, whose weight is then dropped (the rows
    sum to less than 1); explicit matmuls too.
    `workspace` (optional, CPU path only) lends scratch buffers that outlive the call;
    `max_group_bytes` caps the K/V gathered for one group of decodes (cache locality)."""
    check_window(window)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    bytes_per_token = 2 * num_kv_heads * head_dim * k_cache.element_size()
    # keys a decode reads: its whole context, or the window (grouping and padding follow it)
    spans = lens if window is None else [min(n, window) for n in lens]
    groups = _length_groups(decodes, spans, bytes_per_token, max_group_bytes)
    # block-diagonal query rows for every token at once (one op per layer, not one per group)
    explicit = bool(softcap) or sinks is not None  # SDPA can do neither
    q_rows = _query_rows(q, num_kv_heads, scale) if (
        groups and (num_kv_heads <= MAX_KV_HEADS_BLOCK_DIAGONAL or explicit)) else None
    for group in groups:
        _decode_batch(q, q_rows, k_cache, v_cache, block_tables, seq_lens, starts, lens, group,
                      scale, window, out, workspace or Workspace(), softcap, sinks)
    for i in range(len(lens)):
        q_len = starts[i + 1] - starts[i]
        if q_len > 1:
            prefill_chunk(q, k_cache, v_cache, block_tables[i], lens[i], starts[i], q_len, scale,
                         window, out, softcap, sinks)
    return out


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(scores / softcap), in place; unchanged when softcap is None."""
    if softcap:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of `scores` with one more logit per row, the row's sink (sinks
    broadcast to scores[..., :1]), whose probability is dropped: exp(s) / (sum exp(s) +
    exp(sink)), as transformers' gpt-oss. A masked (-inf) score still gets 0."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def check_window(window: int | None) -> None:
    """A window covers at least the query's own key (so no row is ever wholly masked)."""
    assert window is None or (isinstance(window, int) and window >= 1), f"bad window {window!r}"


def first_visible_key(first_query_pos: int, window: int | None) -> int:
    """The lowest key position any query at or after `first_query_pos` can see."""
    return 0 if window is None else max(0, first_query_pos - window + 1)


def _length_groups(decodes: list[int], lens: list[int], bytes_per_token: int,
                   max_group_bytes: int) -> list[list[int]]:
    """Split decodes into groups of similar context length (each pads to its longest, so a few
    long sequences do not make every short one attend over padding), each small enough that its
    gathered K/V stays in the CPU's cache between the gather and the two matmuls."""
    groups: list[list[int]] = []
    first_len = 0
    for i in sorted(decodes, key=lambda j: lens[j]):
        fits = bool(groups) and (len(groups[-1]) + 1) * lens[i] * bytes_per_token <= max_group_bytes
        if fits and lens[i] <= 2 * first_len + 64:
            groups[-1].append(i)
        else:
            groups.append([i])
            first_len = lens[i]
    return groups


def _decode_batch(q: torch.Tensor, q_rows: torch.Tensor | None, k_cache: torch.Tensor,
                  v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: list[int],
                  lens: list[int], decodes: list[int], scale: float, window: int | None,
                  out: torch.Tensor, workspace: Workspace, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> None:
    """One-token queries at once: gather each sequence's blocks (from the first one holding a
    key inside the window), pad to the longest, mask."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    n = len(decodes)
    if n == len(lens):  # every sequence, in batch order (the group is sorted by length)
        decodes = list(range(n))
    first_blocks = [first_visible_key(lens[i] - 1, window) // block_size for i in decodes]
    num_blocks = max(-(-lens[i] // block_size) - b
                     for i, b in zip(decodes, first_blocks, strict=True))
    q_src = q if q_rows is None else q_rows
    device = q.device  # every index and mask made here lives beside the inputs (the CUDA path)
    if n == len(lens):  # the common all-decode step: no index gathers on the small tensors
        tables, ctx_lens, q_d = block_tables, seq_lens, q_src
    else:
        seq_idx = torch.tensor(decodes, dtype=torch.int64, device=device)
        tok_idx = torch.tensor([starts[i] for i in decodes], dtype=torch.int64, device=device)
        tables = block_tables.index_select(0, seq_idx)
        ctx_lens, q_d = seq_lens.index_select(0, seq_idx), q_src.index_select(0, tok_idx)
    max_len = num_blocks * block_size
    key_pos = torch.arange(max_len, device=device)[None, :]  # [1, max_len] within the gathered keys
    if any(first_blocks):  # a window starts past block 0: shift each row of the table
        first = torch.tensor(first_blocks, dtype=torch.int64, device=device)[:, None]  # [n, 1]
        cols = first + torch.arange(num_blocks, device=device)[None, :]
        cols = cols.clamp_(max=tables.shape[1] - 1)
        tables = torch.gather(tables, 1, cols)  # [n, num_blocks]; clamped columns are masked
        key_pos = key_pos + first * block_size  # [n, max_len] absolute key positions
    else:
        tables = tables[:, :num_blocks]
    flat = tables.reshape(-1).long()
    row = block_size * num_kv_heads * head_dim
    k = workspace.get("k", (flat.shape[0], row), k_cache)
    v = workspace.get("v", (flat.shape[0], row), v_cache)
    torch.index_select(k_cache.view(-1, row), 0, flat, out=k)  # one copy per cache, 2-D rows
    torch.index_select(v_cache.view(-1, row), 0, flat, out=v)
    mask = key_pos < ctx_lens[:, None]  # [n, max_len]
    if window is not None:  # the query sits at ctx_len - 1: keys in (ctx_len - 1 - window, ..]
        mask &= key_pos >= ctx_lens[:, None] - window
    if q_rows is not None:
        o = _block_diagonal(q_d, k.view(n, max_len, -1), v.view(n, max_len, -1), mask,
                            num_kv_heads, softcap, sinks)
    else:  # [n, num_kv_heads, max_len, head_dim] views: the layout SDPA wants
        k = k.view(n, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(n, max_len, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q_d.view(n, num_heads, 1, head_dim), k, v, attn_mask=mask[:, None, None, :],
            scale=scale, enable_gqa=num_heads != num_kv_heads).view(n, num_heads, head_dim)
    if n == len(lens):
        out.copy_(o)
    else:
        out.index_copy_(0, tok_idx, o)


def _query_rows(q: torch.Tensor, num_kv_heads: int, scale: float) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> scaled rows [num_tokens, num_heads, num_kv_heads *
    head_dim], head h's query in the slot of its KV head and zeros elsewhere (_block_diagonal)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    eye = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device)
    rows = (q.view(num_tokens, num_kv_heads, group, 1, head_dim) * scale
            * eye.view(1, num_kv_heads, 1, num_kv_heads, 1))  # [T, kvh, group, kvh, head_dim]
    return rows.view(num_tokens, num_heads, num_kv_heads * head_dim)


def _block_diagonal(q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    num_kv_heads: int, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention as two plain batched matmuls over the gathered rows, no transposes.

    q_rows [n, num_heads, num_kv_heads * head_dim] from _query_rows; k, v [n, max_len,
    num_kv_heads * head_dim] (the cache's own row layout); mask [n, max_len]. The zero-padded
    query rows let `q_rows @ k^T` and `p @ v` read each key and value once (num_kv_heads times the
    FLOPs, negligible for few KV heads, and far fewer passes than SDPA's per-head decode loop).
    Returns [n, num_heads, head_dim].
    """
    n, num_heads, width = q_rows.shape
    group, head_dim = num_heads // num_kv_heads, width // num_kv_heads
    scores = soft_cap(torch.bmm(q_rows, k.transpose(1, 2)), softcap)  # [n, num_heads, max_len]
    scores.masked_fill_(~mask[:, None, :], float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, num_heads, 1))
    o = torch.bmm(probs, v)  # [n, num_heads, num_kv_heads * head_dim]
    o = o.view(n, num_kv_heads, group, num_kv_heads, head_dim)
    return torch.diagonal(o, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, num_heads, head_dim)


def prefill_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int, start: int, q_len: int, scale: float,
                 window: int | None, out: torch.Tensor, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> None:
    """One chunk of q_len new tokens whose first sits at position seq_len - q_len; only the
    blocks from the first key the chunk's first query can see are read."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    first_block = first_visible_key(seq_len - q_len, window) // block_size
    base = first_block * block_size  # position of the first gathered key
    blocks = block_table[first_block: -(-seq_len // block_size)].long()
    k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len - base]
    v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len - base]
    q_i = q[start:start + q_len].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
    k = k.transpose(0, 1)[None]  # [1, num_kv_heads, seq_len - base, head_dim]
    v = v.transpose(0, 1)[None]
    gqa = num_heads != num_kv_heads
    if softcap or sinks is not None:
        out[start:start + q_len] = _explicit_chunk(q_i[0], k[0], v[0], seq_len, base, scale,
                                                   window, softcap, sinks)
        return
    if q_len == seq_len and (window is None or window >= seq_len):  # a whole prompt: causal
        o = F.scaled_dot_product_attention(q_i, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # query j (position seq_len - q_len + j) sees keys up to its position, in the window
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(base, seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [q_len, seq_len - base]
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q_i, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out[start:start + q_len] = o[0].transpose(0, 1)


def _explicit_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, base: int,
                    scale: float, window: int | None, softcap: float | None,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """prefill_chunk with soft-capped scores and/or sinks: q [num_heads, q_len, D], k and v
    [num_kv_heads, seq_len - base, D] -> [q_len, num_heads, D]."""
    num_heads, q_len, _ = q.shape
    group = num_heads // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = soft_cap(torch.matmul(q, k.transpose(1, 2)) * scale, softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(base, seq_len, device=q.device)[None, :]
    mask = k_pos <= q_pos  # [q_len, seq_len - base]
    if window is not None:
        mask &= k_pos > q_pos - window
    scores.masked_fill_(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(num_heads, 1, 1))
    return torch.matmul(probs, v).transpose(0, 1)
