"""Model ids through the local hub cache (``paged_jax/model/hub.py``), in a fake cache."""

import os
import shutil

import pytest

from paged_jax import LLM
from paged_jax.model import HFDirectory, open_source
from paged_jax.model.gguf import GGUFFile
from paged_jax.model.hub import cache_dir, resolve_snapshot

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"


def _repo(cache, model_id, refs, files_from):
    repo = cache / ("models--" + model_id.replace("/", "--"))
    for name, commit in refs.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
    for commit, src in files_from.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        if os.path.isdir(src):
            for f in os.listdir(src):
                shutil.copy(os.path.join(src, f), snap / f)
        else:
            shutil.copy(src, snap / os.path.basename(src))
    return repo


@pytest.fixture
def cache(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    _repo(hub, "acme/tiny", {"main": COMMIT, "v2": OTHER},
          {COMMIT: os.path.join(FIXTURES, "llama_text"), OTHER: os.path.join(FIXTURES, "qwen2")})
    _repo(hub, "acme/tiny-gguf", {"main": COMMIT}, {COMMIT: os.path.join(FIXTURES, "gguf", "mistral.Q4_0.gguf")})
    return hub


def test_cache_dir_precedence(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == os.path.join(str(tmp_path), ".cache", "huggingface", "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cache_dir() == str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "x"))
    assert cache_dir() == str(tmp_path / "x")


def test_main_and_named_revisions(cache):
    main = open_source("acme/tiny")
    assert isinstance(main, HFDirectory) and main.path.endswith(COMMIT)
    assert main.config["architectures"] == ["LlamaForCausalLM"]
    v2 = open_source("acme/tiny", revision="v2")
    assert v2.config["architectures"] == ["Qwen2ForCausalLM"]
    assert resolve_snapshot("acme/tiny", OTHER).endswith(OTHER)  # a commit hash as the revision


def test_hf_home(cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the fake cache
    assert open_source("acme/tiny").path.endswith(COMMIT)


def test_gguf_snapshot(cache):
    assert isinstance(open_source("acme/tiny-gguf"), GGUFFile)


def test_llm_from_a_model_id(cache):
    llm = LLM("acme/tiny", num_gpu_blocks=8, block_size=4, max_model_len=16, max_num_seqs=1)
    assert llm.get_tokenizer() is not None
    llm = LLM("acme/tiny", revision="v2", num_gpu_blocks=8, block_size=4, max_model_len=16, max_num_seqs=1)
    assert llm.config.model.architecture.architecture == "Qwen2ForCausalLM"


def test_missing_model_names_the_paths(cache):
    with pytest.raises(ValueError, match=r"not in the local hub cache \(looked at .*models--acme--absent.*never downloads"):
        open_source("acme/absent")


def test_missing_revision_names_the_ref(cache):
    with pytest.raises(ValueError, match=r"no revision 'v9'.*refs/v9.*revisions there: main, v2"):
        open_source("acme/tiny", revision="v9")


def test_dangling_ref(cache):
    (cache / "models--acme--tiny" / "refs" / "broken").write_text("f" * 40)
    with pytest.raises(ValueError, match="names commit f{40} but .* does not exist"):
        open_source("acme/tiny", revision="broken")
