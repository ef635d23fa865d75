"""Two tensor-parallel ranks (gloo on CPU), each loading its shard, give transformers' logits."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.loader import load_model
from tests.worker.conftest import save_tiny_model
from tests.worker.paged_batch import prefill_then_decode

PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [100, 2, 7, 7, 13, 54, 21, 90, 1, 11, 64], [33]]


def _rank_main(rank: int, world_size: int, port: int, folders: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        for folder in folders:
            model, config = load_model(folder, dtype="float32", tp_rank=rank, tp_size=world_size)
            pool = KVPool.for_model(config, num_blocks=16, block_size=4, dtype=torch.float32,
                                    tp_size=world_size)
            results[folder] = prefill_then_decode(model, pool.kv_caches, PROMPTS, 4, 16, decode_steps=2)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_transformers(tmp_path: Path) -> None:
    # llama: 2 KV heads split over 2 ranks, tied embeddings, vocab 101 padded to 2 x 51;
    # qwen2: its single KV head replicated on both ranks, QKV bias
    folders = [str(save_tiny_model(kind, tmp_path / kind)) for kind in ("llama", "qwen2")]
    mp.spawn(_rank_main, args=(2, _free_port(), folders, str(tmp_path / "out")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(2)]
    for folder in folders:
        reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        for (tokens, logits), (_, other_rank) in zip(ranks[0][folder], ranks[1][folder], strict=True):
            with torch.no_grad():
                expected = reference(torch.tensor([tokens])).logits[0, -len(logits):]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
            torch.testing.assert_close(other_rank, logits, atol=0, rtol=0)
