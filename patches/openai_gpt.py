"""OpenAI GPT (openai-gpt): its hand-written attention ported to transformers' AttentionInterface (patches/ported.py).

The model has no KV cache: every forward (each generation step too) runs the whole sequence, which context
parallelism shards as any prefill without a cache. `Attention._attn` scores q.k (divided by sqrt(head_dim) where
`scale`), fills what its causal buffer hides with -1e4 rather than -inf, adds the padding mask, softmaxes and
applies dropout. A real token's row is the same either way: the -1e4 columns are future tokens, whose exp(-1e4 - max)
is 0 in fp32 and fp64 alike (a left-padded row's pad queries, which see only masked keys, put their weight on those
future tokens instead; their outputs are never read: a pad key is masked for every real query). The ported forward
computes q/k/v as the model does, stores K/V in the cache hf-contextpar makes for the forward (the model takes none:
each rank's K/V block is read from it, as for every family; it is dropped with the forward, so every generation step
runs the whole sequence again, as on one process) and calls the attention the config names with the model's scaling,
so hf-contextpar's attention takes over under context parallelism; under transformers' own attention the model's
forward runs unchanged.
"""

from __future__ import annotations

import math

from hf_contextpar.attention import current_step

from . import ported


def _forward(self, x, attention_mask=None, output_attentions=False):
    """transformers' openai Attention.forward (5.x), through hf-contextpar's attention."""
    if not ported.switched(self.config):  # transformers' own attention: the model's forward
        return type(self).forward(self, x, attention_mask, output_attentions)
    query, key, value = self.c_attn(x).split(self.split_size, dim=2)
    query, key, value = (self.split_heads(t) for t in (query, key, value))
    cache = current_step.get().cache  # the forward's own (the model takes none): each rank's K/V go through it
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    attention = ported.attention_function(self.config, None)
    scaling = 1.0 / math.sqrt(value.shape[-1]) if self.scale else 1.0
    dropout = self.attn_dropout.p if self.training else 0.0
    # the model's mask is its caller's padding made 4D (finfo.min on pad keys), which hf-contextpar reads from the
    # plan instead (-inf on pad keys: the same rows for every real token)
    out, _ = attention(self, query, key, value, None, scaling=scaling, dropout=dropout)
    out = self.c_proj(out.reshape(*x.shape[:-1], -1))
    return [self.resid_dropout(out)]


def apply(model):
    """Port every openai Attention of `model` (reversible); returns undo()."""
    blocks = [m for m in model.modules() if type(m).__name__ == "Block" and type(m).__module__.endswith("openai")]
    index = {id(block.attn): i for i, block in enumerate(blocks)}

    def attributes(module):
        return dict(config=model.config, layer_idx=index[id(module)], num_key_value_groups=1, is_causal=True)

    return ported.port(model, "Attention", _forward, attributes)
