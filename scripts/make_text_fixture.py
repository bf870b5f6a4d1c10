"""Generate ``tests/fixtures/llama_text/``: a tiny random-weight Llama checkpoint *with* a tokenizer.

Needs only this repository's own dependencies (``tokenizers``, JAX/Flax, safetensors);
no torch, no transformers. Deterministic: rerunning it rewrites the same files.

    .venv/bin/python scripts/make_text_fixture.py [--out tests/fixtures/llama_text]

It writes, next to the shipped training text ``corpus.txt`` (original sentences with
accented Latin, CJK and emoji, so multi-byte characters and tokens that split them occur):

- ``tokenizer.json``: a byte-level BPE trained on ``corpus.txt`` (ByteLevel pre-tokenizer
  without prefix space, ByteLevel decoder, Llama-3's post-processor: ByteLevel then a
  ``TemplateProcessing`` that prepends ``<|begin_of_text|>``); 395 learned tokens (the
  256 bytes + merges) then the five Llama-3 special tokens, ids 395..399.
- ``tokenizer_config.json`` / ``special_tokens_map.json``: BOS ``<|begin_of_text|>``,
  EOS ``<|eot_id|>`` (Llama-3 instruct), ``add_bos_token``, a Llama-3 style chat template.
- ``generation_config.json``: EOS ``[<|end_of_text|>, <|eot_id|>]``, sampling defaults.
- ``config.json``: LlamaForCausalLM (hidden 64, 2 layers, 4/2 heads, head_dim 16), its
  vocabulary the tokenizer's rounded up to a multiple of 64, bf16.
- ``model.safetensors``: ``init_params`` weights (seed 0) in bf16, via ``save_params``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "tests", "fixtures", "llama_text")

LEARNED_VOCAB = 395  # 256 byte tokens + 139 merges
SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
)
BOS, END_OF_TEXT, EOT = SPECIAL_TOKENS[:3]
MAX_LEN = 256
SEED = 0

# Llama-3 instruct's shape: BOS once, a header per message, <|eot_id|> after each message
# (content trimmed), then an assistant header when a reply is wanted.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def build_tokenizer(corpus: str):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=LEARNED_VOCAB, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([corpus], trainer)
    assert tok.get_vocab_size() == LEARNED_VOCAB, tok.get_vocab_size()
    # Added after training so they sit at the end of the vocabulary, as in Llama-3.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos)],
        ),
    ])
    return tok


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    out = args.out
    os.makedirs(out, exist_ok=True)
    corpus = os.path.join(out, "corpus.txt")
    if not os.path.isfile(corpus):
        corpus = os.path.join(DEFAULT_OUT, "corpus.txt")

    tok = build_tokenizer(corpus)
    tok.save(os.path.join(out, "tokenizer.json"), pretty=True)
    ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    vocab = tok.get_vocab_size(with_added_tokens=True)
    model_vocab = -(-vocab // 64) * 64

    added = {
        str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
        for s in SPECIAL_TOKENS
    }
    _write_json(os.path.join(out, "tokenizer_config.json"), {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MAX_LEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    _write_json(os.path.join(out, "special_tokens_map.json"), {"bos_token": BOS, "eos_token": EOT})
    _write_json(os.path.join(out, "generation_config.json"), {
        "bos_token_id": ids[BOS],
        "do_sample": True,
        "eos_token_id": [ids[END_OF_TEXT], ids[EOT]],
        "temperature": 0.6,
        "top_p": 0.9,
    })
    _write_json(os.path.join(out, "config.json"), {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS],
        "dtype": "bfloat16",
        "eos_token_id": ids[END_OF_TEXT],
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": MAX_LEN,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": model_vocab,
    })

    sys.path.insert(0, ROOT)
    from safetensors import safe_open

    from paged_jax.model import ModelConfig, init_params, load_model, save_params
    from paged_jax.text import Tokenizer

    config = ModelConfig.from_hf(out)
    _, params = init_params(config, seed=SEED)
    save_params(out, params)

    # Verify: the model loads back, the tensors are bf16, every id the tokenizer makes fits.
    loaded_config, _, _ = load_model(out)
    assert loaded_config == config, (loaded_config, config)
    with safe_open(os.path.join(out, "model.safetensors"), framework="numpy") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"BF16"}, dtypes
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer is not None and len(tokenizer) == vocab <= config.vocab_size
    with open(corpus, encoding="utf-8") as f:
        text = f.read()
    encoded = tokenizer.encode(text)
    assert encoded[0] == ids[BOS] and max(encoded) < config.vocab_size
    assert tokenizer.decode(encoded) == text
    sizes = {name: os.path.getsize(os.path.join(out, name)) for name in sorted(os.listdir(out))}
    print(json.dumps({"special_ids": ids, "tokenizer_vocab": vocab, "model_vocab": model_vocab,
                      "corpus_tokens": len(encoded), "bytes": sizes}, indent=1))

if __name__ == "__main__":
    main()
