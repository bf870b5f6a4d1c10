"""Write the tiny GGUF fixtures (tests/fixtures/gguf/) and transformers' outputs for them.

Run in the fixtures side venv (torch, transformers, gguf), never in the project's:

    PY=$(scripts/side_venv.sh fixtures | tail -1)
    $PY scripts/make_gguf_fixtures.py

Files, each written with ``gguf.GGUFWriter`` as llama.cpp's ``convert_hf_to_gguf.py`` writes
them (norms F32, Q/K rows permuted for ``llama``, byte-level vocabulary spelled as in
tokenizer.json, control tokens typed 3):

- ``llama_text.<TYPE>.gguf`` for TYPE in F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0: the
  ``tests/fixtures/llama_text`` checkpoint (with its byte-level BPE tokenizer and chat
  template) quantised by ``gguf.quants.quantize``; the Q8_0 file has no ``output.weight``
  (embeddings tied, as llama.cpp writes a tied model).
- ``kquant.<TYPE>.gguf`` for Q2_K..Q6_K (gguf has no K-quantiser): a 1-layer llama of
  widths 256 (K blocks are 256 wide) whose weights are random valid blocks, scales set so
  the weights have std ~0.05.
- ``qwen2.Q8_0.gguf`` (tests/fixtures/qwen2: biases, no permutation, tied) and
  ``mistral.Q4_0.gguf`` (tests/fixtures/mistral, arch ``llama`` named mistral, 1 kv head).
- ``sp_tokenizer.gguf``: a SentencePiece-style ``llama`` vocabulary (BPE trained here on the
  corpus, byte-fallback tokens, scores, no merges) and no tensors.

``transformers_outputs.npz`` (not ``expected.npz``: test_checkpoint runs every directory
holding one): per model file, logits of two prompts and 8 greedy tokens computed by
transformers' own GGUF path (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``,
float32); per tokenizer file, transformers' GGUF tokenizer ids of the corpus lines.
``metadata.json`` records the versions.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "gguf")
PROMPTS = ([3, 17, 42, 60, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
GREEDY = 8
BLOCK_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py): Q/K rows to interleaved RoPE pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_checkpoint(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    import torch
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update({k: v.to(torch.float32).numpy() for k, v in load_file(os.path.join(path, name)).items()})
    return config, tensors


LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    layer, rest = parts[2], ".".join(parts[3:])
    for key, short in LAYER.items():
        if rest == key:
            return f"blk.{layer}.{short}"
        if rest.startswith(key + "."):
            return f"blk.{layer}.{short}.{rest[len(key) + 1:]}"
    raise KeyError(hf)


def add_tensor(writer, name: str, w: np.ndarray, qtype) -> None:
    import gguf

    t = gguf.GGMLQuantizationType
    if w.ndim == 1 or qtype == t.F32:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif qtype == t.F16:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype),
                          raw_dtype=qtype)


def write_header(writer, config: dict, name: str) -> None:
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])


def rope_theta(config: dict) -> float:
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def llama3_rope_freqs(config: dict) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs`` tensor for a llama3-scaled config (convert_hf_to_gguf.py's
    LlamaModel): per RoPE pair, the divisor of its frequency; None for other configs."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    heads = config["num_attention_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for f in rope_theta(config) ** (-np.arange(0, d, 2, dtype=np.float64) / d):
        wavelen = 2 * np.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_bpe_tokenizer(writer, path: str, vocab_size: int) -> None:
    """tokenizer.json (byte-level BPE) + tokenizer_config.json as llama.cpp writes them."""
    with open(os.path.join(path, "tokenizer.json")) as f:
        tj = json.load(f)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tc = json.load(f)
    vocab = dict(tj["model"]["vocab"])
    specials = {a["content"]: a["id"] for a in tj["added_tokens"]}
    by_id = {i: t for t, i in {**vocab, **specials}.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(3 if by_id[i] in specials else 1)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED, as convert_hf_to_gguf pads a vocabulary
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(specials[tc["bos_token"]])
    writer.add_eos_token_id(specials[tc["eos_token"]])
    writer.add_eot_token_id(specials["<|eot_id|>"])
    writer.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    writer.add_add_eos_token(bool(tc.get("add_eos_token", False)))
    writer.add_chat_template(tc["chat_template"])


def write_model(path_out: str, config: dict, tensors: dict, qtype, *, arch: str = "llama", name: str,
                tokenizer_dir: str | None = None, tie: bool = False) -> None:
    import gguf

    writer = gguf.GGUFWriter(path_out, arch)
    write_header(writer, config, name)
    if tokenizer_dir is not None:
        write_bpe_tokenizer(writer, tokenizer_dir, config["vocab_size"])
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    freqs = llama3_rope_freqs(config)
    if freqs is not None:
        writer.add_tensor("rope_freqs.weight", freqs)
    for hf, w in tensors.items():
        if hf == "lm_head.weight" and tie:
            continue
        if arch == "llama" and ".q_proj." in hf:
            w = permute(w, heads)
        elif arch == "llama" and ".k_proj." in hf:
            w = permute(w, kv)
        add_tensor(writer, gguf_name(hf), w, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# K-quant layouts (QK_K = 256): block bytes and the byte offsets of the f16 scales d (and dmin).
K_LAYOUT = {"Q2_K": (84, 80, 82), "Q3_K": (110, 108, None), "Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2),
            "Q6_K": (210, 208, None)}


def random_k_blocks(rng, rows: int, cols: int, qname: str, std: float = 0.05) -> np.ndarray:
    """Random valid blocks of a K type: random quants and sub-scales, the f16 super-scales set
    so that the dequantised weights have standard deviation ``std``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qname]
    size, d_at, dmin_at = K_LAYOUT[qname]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)

    def set_scales(scale: float) -> None:
        for at in (d_at, dmin_at):
            if at is not None:
                blocks[:, at:at + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)

    set_scales(1.0)
    probe = gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)
    set_scales(std / float(probe.std()))
    return blocks.reshape(rows, -1)


def write_kquant(path_out: str, qname: str, seed: int) -> dict:
    import gguf

    rng = np.random.default_rng(seed)
    config = dict(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, max_position_embeddings=128, rope_theta=10000.0,
                  rms_norm_eps=1e-5)
    qtype = gguf.GGMLQuantizationType[qname]
    writer = gguf.GGUFWriter(path_out, "llama")
    write_header(writer, config, f"kquant-{qname}")
    shapes = {"token_embd.weight": (64, 256), "blk.0.attn_q.weight": (256, 256), "blk.0.attn_k.weight": (128, 256),
              "blk.0.attn_v.weight": (128, 256), "blk.0.attn_output.weight": (256, 256),
              "blk.0.ffn_gate.weight": (256, 256), "blk.0.ffn_up.weight": (256, 256),
              "blk.0.ffn_down.weight": (256, 256)}
    for name, (rows, cols) in shapes.items():
        std = 1.0 if name == "token_embd.weight" else 0.05
        writer.add_tensor(name, random_k_blocks(rng, rows, cols, qname, std), raw_dtype=qtype)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(256)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config


def write_sp_tokenizer(path_out: str, corpus: list[str]) -> None:
    """A SentencePiece-style vocabulary as llama.cpp writes one (``tokenizer.ggml.model``
    ``llama``): <unk> <s> </s>, the 256 byte tokens <0xNN> (type 6), then BPE pieces with
    ``▁`` for spaces, scores = -rank, no merges (the reader derives them from the scores)."""
    import gguf
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer(add_prefix_space=True)
    sp.train_from_iterator(corpus, vocab_size=180, min_frequency=2, show_progress=False, special_tokens=[])
    learned = sorted(sp.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    seen = set(tokens)
    for piece, _ in learned:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
    assert len(tokens) <= 448, len(tokens)  # fits llama_text's vocabulary (the tokenizer= override test)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    writer = gguf.GGUFWriter(path_out, "llama")
    write_header(writer, dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=4), "sp-tokenizer")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_outputs(file: str) -> dict[str, np.ndarray]:
    """Logits of PROMPTS and GREEDY greedy tokens from transformers' GGUF loader (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(OUT, gguf_file=os.path.basename(file), dtype=torch.float32)
    model.eval()
    out = {}
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out[f"logits_{i}"] = model(ids).logits[0].numpy()
            gen = model.generate(ids, max_new_tokens=GREEDY, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 min_new_tokens=GREEDY)
        out[f"greedy_{i}"] = gen[0, len(prompt):].numpy().astype(np.int32)
    return out


def main() -> None:
    import gguf
    import torch
    import transformers
    from transformers import AutoTokenizer

    os.makedirs(OUT, exist_ok=True)
    t = gguf.GGMLQuantizationType
    expected, files = {}, {}
    text_dir = os.path.join(ROOT, "llama_text")
    config, tensors = read_checkpoint(text_dir)
    for qname in BLOCK_TYPES:
        file = os.path.join(OUT, f"llama_text.{qname}.gguf")
        write_model(file, config, tensors, t[qname], name="llama-text-fixture", tokenizer_dir=text_dir,
                    tie=qname == "Q8_0")
        files[os.path.basename(file)] = {"arch": "llama", "type": qname, "tied": qname == "Q8_0", "source": "llama_text"}
    for qname in K_TYPES:
        file = os.path.join(OUT, f"kquant.{qname}.gguf")
        write_kquant(file, qname, seed=K_TYPES.index(qname))
        files[os.path.basename(file)] = {"arch": "llama", "type": qname, "tied": True, "source": "random K blocks"}
    config, tensors = read_checkpoint(os.path.join(ROOT, "qwen2"))
    write_model(os.path.join(OUT, "qwen2.Q8_0.gguf"), config, tensors, t.Q8_0, arch="qwen2", name="qwen2-fixture",
                tie=True)
    files["qwen2.Q8_0.gguf"] = {"arch": "qwen2", "type": "Q8_0", "tied": True, "source": "qwen2"}
    config, tensors = read_checkpoint(os.path.join(ROOT, "mistral"))
    write_model(os.path.join(OUT, "mistral.Q4_0.gguf"), config, tensors, t.Q4_0, name="mistral-fixture")
    files["mistral.Q4_0.gguf"] = {"arch": "llama", "type": "Q4_0", "tied": False, "source": "mistral"}

    for name in files:
        for key, value in transformers_outputs(os.path.join(OUT, name)).items():
            expected[f"{name}/{key}"] = value
        print(name, os.path.getsize(os.path.join(OUT, name)), file=sys.stderr)

    with open(os.path.join(text_dir, "corpus.txt"), encoding="utf-8") as f:
        corpus = [line for line in f.read().splitlines() if line.strip()]
    write_sp_tokenizer(os.path.join(OUT, "sp_tokenizer.gguf"), corpus)
    for name in ("llama_text.F16.gguf", "sp_tokenizer.gguf"):
        tok = AutoTokenizer.from_pretrained(OUT, gguf_file=name)
        for j, line in enumerate(corpus):
            expected[f"{name}/tokens_{j}"] = np.asarray(tok(line)["input_ids"], dtype=np.int32)
    np.savez_compressed(os.path.join(OUT, "transformers_outputs.npz"), **expected)
    meta = {"prompts": [list(p) for p in PROMPTS], "greedy": GREEDY, "corpus_lines": len(corpus), "files": files,
            "gguf": gguf.__version__ if hasattr(gguf, "__version__") else None,
            "transformers": transformers.__version__, "torch": torch.__version__}
    with open(os.path.join(OUT, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=2)


if __name__ == "__main__":
    main()
