"""The rollout engine: a jit-compiled sampler with a KV cache (prefill once, decode in a loop).

from jaxrl_llm import models, rollout
path = models.default_model_path()
model, tokenizer = models.from_pretrained(path), models.load_tokenizer(path)
ids, mask = rollout.encode_prompts(tokenizer, ["What is 2 + 3?"])
out = rollout.generate(model, ids, mask, rng=jax.random.key(0), max_new_tokens=32,
                       num_samples=4, temperature=1.0)
rollout.decode_completions(tokenizer, out.tokens, out.mask)   # [B][G] strings
"""

from jaxrl_llm.rollout import paged, partial
from jaxrl_llm.rollout.engine import Generation, generate
from jaxrl_llm.rollout.sampling import sample
from jaxrl_llm.rollout.text import completion_ids, decode_completions, encode_prompts

__all__ = [
    "Generation",
    "completion_ids",
    "decode_completions",
    "encode_prompts",
    "generate",
    "paged",
    "partial",
    "sample",
]
