"""DSA's bytes under context parallelism: what a rank receives in a prefill and in the decode step after it.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 dev/dsa_bytes.py
The tiny DeepSeek-V3.2 (patches/: the checkpoint's 512 + 64 latent, its 128-number index key) in bf16, ring
pass-KV, T = 4,096: the measured attention bytes next to the latent ring's share and the index keys' gather
(docs/design.md, "Indexed attention").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import hf_contextpar
from hf_contextpar.models import tiny_model

T = 4096


@torch.no_grad()
def main():
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    cp = hf_contextpar.apply_context_parallel(tiny_model("deepseek_v32", dtype=torch.bfloat16), strategy="ring_pass_kv")
    runtime = hf_contextpar.get_runtime(cp)
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    out = cp(ids)
    prefill = runtime.last_forward["bytes_received"]
    cp(ids[:, :1], past_key_values=out.past_key_values)
    decode = runtime.last_forward["bytes_received"]
    c = cp.config
    latent, index, layers = (c.kv_lora_rank + c.qk_rope_head_dim) * 2, c.index_head_dim * 2, c.num_hidden_layers
    if rank == 0:
        print(f"N={n} T={T} bf16: latent {latent} B a token, index key {index} B ({index / latent:.0%})")
        print(
            f"prefill: received {prefill} B; latent ring (N-1)/N T latent L = {(n - 1) * T // n * latent * layers}, "
            f"index keys (T - T/N) index L = {(T - T // n) * index * layers}"
        )
        print(
            f"decode step: received {decode} B; index keys ~ (T + 1)(N-1)/N index L = {(T + 1) * (n - 1) // n * index * layers}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
