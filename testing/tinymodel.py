"""Build a random-weight Llama-style model and a byte-level BPE tokenizer on local disk, for tests and benchmarks.

No hub is reachable from the machines this runs on, so the engine tests make
their own model: a tokenizer trained with ``tokenizers`` on generated text
(with a chat template, saved as a ``PreTrainedTokenizerFast``) and a
``LlamaForCausalLM`` with random weights from a fixed seed. Greedy output of
such a model is noise, but deterministic noise: exactly what a test that
compares KV loaded from the pool with recomputed KV needs.

Needs ``torch``, ``transformers`` and ``tokenizers`` (the vLLM environment has
them); run it with that interpreter: ``python -m daybreak.testing.tinymodel --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = ("daybreak pool block cache prefill decode token engine layer head vector tensor memory "
          "agent store tier key value shard batch kernel stream queue socket buffer segment").split()


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the generated model; the defaults build about 5 M parameters in seconds."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    vocab: int = 4096
    max_positions: int = 4096
    seed: int = 0
    init_std: float = 0.2


SMALL = ModelShape()
# About 111 M parameters: prefill is slow enough on one core to show what a cache hit saves.
BENCH = ModelShape(hidden=1024, layers=8, heads=16, kv_heads=16, intermediate=2816)


def _corpus(seed: int, *, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(rng.randrange(5, 30)))
            for _ in range(lines)]


def build(out: Path, shape: ModelShape = SMALL) -> Path:
    """Write the model and tokenizer into ``out`` (reused when ``out`` already holds this shape)."""
    stamp = out / "daybreak-tinymodel.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(shape):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    special = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=shape.vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(shape.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(shape.seed)
    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads, max_position_embeddings=shape.max_positions,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False, dtype="bfloat16",
        # Far above the usual 0.02, so that attention (and thus every cached K and V) visibly steers the
        # greedy output: a test that corrupts KV must see different tokens.
        initializer_range=shape.init_std,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(shape)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--shape", choices=["small", "bench"], default="small",
                        help="small: ~5 M parameters (tests); bench: ~111 M (prefill-dominated TTFT)")
    args = parser.parse_args(argv)
    print(build(args.out, SMALL if args.shape == "small" else BENCH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
