"""SGLang ``ForwardBatch`` rows -> :class:`StepRow` of the tangram cache's running requests.

Row i of a forward batch is request ``forward_batch.rids[i]`` (SGLang builds ``rids`` from the same
``ScheduleBatch.reqs`` that gives ``req_pool_indices``; the memory hook registered each of those requests
with the manager under ``req.rid`` before its first extend). The manager's own state says what a row is:

- EXTEND / MIXED rows whose request has a reserved segment are extend rows; the segment must cover
  exactly ``[extend_prefix_lens[i], extend_prefix_lens[i] + extend_seq_lens[i])``.
- DECODE rows, and MIXED rows of one token whose request has no reserved segment (the running requests
  ``mix_with_running`` adds), are decode rows: the token at position ``len(cached tokens)``. Its id is not
  read (``input_ids`` may still be on its way to the GPU under overlap scheduling): the manager records it as
  unresolved and the radix cache resolves it from SGLang's ``req`` before the tree keys it.
Anything else (another forward mode, a row that does not match the cache) raises :class:`StepError`.
"""

from __future__ import annotations

from typing import Any

from tangram_sgl.attention.forward_step import StepError, StepRow
from tangram_sgl.pool.kv_manager import TangramKVManager


def batch_rows(fb: Any, kv: TangramKVManager) -> list[StepRow]:
    """The rows of forward batch ``fb`` (see module docstring); no device data is read."""
    mode = fb.forward_mode
    if fb.rids is None or len(fb.rids) != fb.batch_size:
        raise StepError(f"the tangram backend maps batch rows to requests through ForwardBatch.rids, which "
                        f"is {'missing' if fb.rids is None else f'of length {len(fb.rids)}'} for a batch of "
                        f"{fb.batch_size}")
    if mode.is_decode():
        rows = [StepRow(rid, _cached(kv, rid), 1, decode=True) for rid in fb.rids]
        seq_lens = fb.seq_lens_cpu.tolist()
        for row, seq_len in zip(rows, seq_lens):
            if seq_len != row.start + 1:
                raise StepError(f"decode row of {row.rid!r}: SGLang's sequence length is {seq_len} but the tangram "
                                f"cache holds {row.start} tokens of it (+1 being decoded)")
        return rows
    if mode.name not in ("EXTEND", "MIXED"):
        raise StepError(f"forward mode {mode.name} is not supported by the tangram attention backend "
                        f"(EXTEND, MIXED and DECODE are)")
    rows = []
    for rid, prefix, n in zip(fb.rids, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        req = kv.requests.get(rid)
        decode = req is not None and req.pending is None and mode.is_mixed() and n == 1
        rows.append(StepRow(rid, prefix, n, decode=decode))
    return rows


def _cached(kv: TangramKVManager, rid: Any) -> int:
    req = kv.requests.get(rid)
    if req is None:
        raise StepError(f"request {rid!r} is not running in the tangram cache (did the alloc_for_extend hook run?)")
    return len(req.token_ids)
