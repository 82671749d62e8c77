"""N ranks: PyTorch's ring attention (the benchmark's peer) against the unpatched model. Prints JSON.

For each rotate method and prompt length, every position's logits (`TorchRing.logits`) and the first
token (`TorchRing.first_token`) against the unpatched model on this one process, and the K/V bytes
the ring sent (unrepeated KV heads: transformers passes enable_gqa with no mask).
"""

import gc
import json
import sys

import torch
import torch.distributed as dist

from hf_contextpar.models import tiny_model
from hf_contextpar.tools.bench.torch_ring import PEERS, TorchRing


def main() -> list:
    """Every result. The peers hold the process group (their DeviceMesh): gone when this returns, so
    destroy_process_group below joins gloo's threads before the interpreter finalizes (module-level
    peers kept it alive into finalization: gloo threads at exit, and now and then a SIGABRT)."""
    torch.manual_seed(0)
    model = tiny_model("llama")  # 2 layers, 4 query heads, 2 KV heads, head_dim 16
    world = dist.get_world_size()
    out = []
    for name, rotate in PEERS.items():
        peer = TorchRing(model, rotate, "cpu")
        for T in (12 * world, 20 * world):  # multiples of 2N, shards of 6 and 10 tokens
            ids = torch.randint(0, 384, (1, T), generator=torch.Generator().manual_seed(T))
            with torch.no_grad():
                ref = model(input_ids=ids).logits
            peer.stats.reset()
            got = peer.logits(ids)
            sent = peer.stats.bytes_sent
            token = peer.first_token(ids)
            out.append(
                dict(
                    peer=name,
                    T=T,
                    shape=list(got.shape),
                    max_abs_diff=(got - ref).abs().max().item(),
                    token=int(token),
                    ref_token=int(ref[0, -1].argmax()),
                    bytes_sent=sent,
                    attn=model.config._attn_implementation,
                )
            )
    try:
        TorchRing(model, "allgather", "cpu").logits(torch.zeros(1, 2 * world + 1, dtype=torch.long))
    except ValueError as e:
        out.append(dict(error=str(e)))
    return out


dist.init_process_group("gloo")
out = main()
gc.collect()
print(json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(0)
