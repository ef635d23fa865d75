"""A minimal stand-in for the scheduler in model tests: block tables and step metadata.

Each sequence gets its physical blocks from a shuffled pool, so logical order never matches
physical order, and tokens reach the model as ragged flat batches, as the engine sends them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.worker.layers import AttentionMetadata


class PagedSequences:
    """Sequences with fixed, shuffled block tables; step() builds one forward's inputs."""

    def __init__(self, num_seqs: int, max_len: int, block_size: int, num_blocks: int, seed: int = 0) -> None:
        per_seq = -(-max_len // block_size)
        assert num_seqs * per_seq <= num_blocks, "pool too small for the test"
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_size = block_size
        self.block_tables = perm[: num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
        self.tokens: list[list[int]] = [[] for _ in range(num_seqs)]

    def step(self, chunks: dict[int, list[int]]) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """(input_ids, positions, meta) for appending chunks[seq] to each listed sequence, in order."""
        ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq, chunk in chunks.items():
            first = len(self.tokens[seq])
            self.tokens[seq].extend(chunk)
            for pos in range(first, first + len(chunk)):
                block = int(self.block_tables[seq, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
            ids.extend(chunk)
            positions.extend(range(first, first + len(chunk)))
            seq_lens.append(len(self.tokens[seq]))
            starts.append(starts[-1] + len(chunk))
        q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=self.block_tables[list(chunks)].contiguous(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta

    @staticmethod
    def last_rows(meta: AttentionMetadata) -> Tensor:
        """Row index of each sequence's last token in the step (where the engine samples)."""
        return meta.query_start_loc[1:].long() - 1



def prefill_then_decode(model: torch.nn.Module, kv_caches: list[tuple[Tensor, Tensor]],
                        prompts: list[list[int]], block_size: int, num_blocks: int,
                        decode_steps: int) -> list[tuple[list[int], Tensor]]:
    """All prompts prefilled in one forward, then greedy decode steps of one token per sequence
    (the second step leaves sequence 1 out, so batches vary). Returns (sequence so far, logits of
    its last len(logits) tokens) pairs: all prompt positions after the prefill, then the newest
    token of each sequence in each decode step."""
    seqs = PagedSequences(len(prompts), max(map(len, prompts)) + decode_steps, block_size, num_blocks)
    ids, positions, meta = seqs.step(dict(enumerate(prompts)))
    logits = model.compute_logits(model(ids, positions, meta, kv_caches))
    starts = meta.query_start_loc.tolist()
    checks = [(list(p), logits[a:b]) for p, a, b in zip(prompts, starts, starts[1:], strict=False)]
    last = {s: row for s, row in enumerate(logits[PagedSequences.last_rows(meta)])}
    for step in range(decode_steps):
        chunks = {s: [int(last[s].argmax())] for s in range(len(prompts)) if not (step == 1 and s == 1)}
        ids, positions, meta = seqs.step(chunks)
        logits = model.compute_logits(model(ids, positions, meta, kv_caches))
        for row, s in enumerate(chunks):
            last[s] = logits[row]
            checks.append((list(seqs.tokens[s]), logits[row : row + 1]))
    return checks
