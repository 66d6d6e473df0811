"""The default corpus: LibreOffice help pages from Debian's ``libreoffice-help-<lang>`` packages.

The packages (MPL-2.0) hold one HTML page per help topic and language; every paragraph carries an
id (``par_id…``, ``hd_id…`` for headings) that is the same in all translations, which makes the
corpus paragraph-aligned. Packages are fetched with ``apt-get download`` and unpacked with
``dpkg -x`` into a cache folder (nothing is installed); the extracted paragraphs are cached as
JSON lines per package, so a second run needs neither apt nor the HTML.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from moe_lit.data.corpus import LOCAL_FOLDER_HINT, Paragraph, normalize
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_text

PACKAGE_PREFIX = "libreoffice-help-"
DEFAULT_LANGUAGES = ("en", "de", "nl", "fr", "es", "it", "pt-br", "pl", "ru")
"""Germanic, Romance and Slavic languages in Latin and Cyrillic script."""
REFERENCE_LANGUAGE = "en"
"""The language the help is written in: a translation equal to it is an untranslated fallback."""
ALIASES = {"en": "en-us"}
"""Short codes for package suffixes."""
NOT_LANGUAGES = ("common",)
APT_LISTS_DIR = Path("/var/lib/apt/lists")
HELP_ROOT = Path("usr/share/libreoffice/help")
SKIPPED_CLASSES = ("code", "codeintable", "smathcode")
"""Paragraph classes holding program code or formulas rather than prose."""


def package_name(lang: str) -> str:
    return PACKAGE_PREFIX + ALIASES.get(lang, lang)


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def _last_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E:")]
    return (errors or lines or [f"exit status {proc.returncode}"])[-1]


def check_tools() -> None:
    """apt-get, apt-cache and dpkg must exist (Debian, Ubuntu and derivatives)."""
    missing = [tool for tool in ("apt-get", "apt-cache", "dpkg") if shutil.which(tool) is None]
    if missing:
        raise MoeLitError(
            f"--source debian needs {', '.join(missing)} (a Debian/Ubuntu system), not found; {LOCAL_FOLDER_HINT}"
        )


def ensure_package_lists(lists_dir: Path = APT_LISTS_DIR, is_root: bool | None = None) -> None:
    """``apt-get download`` needs package lists: run ``apt-get update`` when there are none (root only)."""
    if any(lists_dir.glob("*_Packages*")):
        return
    if not (os.geteuid() == 0 if is_root is None else is_root):
        raise MoeLitError(
            f"apt package lists are empty ({lists_dir}); run 'sudo apt-get update' first, or {LOCAL_FOLDER_HINT}"
        )
    print("apt package lists are empty: running apt-get update", flush=True)
    proc = _run(["apt-get", "update"])
    if proc.returncode != 0:
        raise MoeLitError(f"apt-get update failed (offline?): {_last_error_line(proc)}; {LOCAL_FOLDER_HINT}")


def available_languages() -> list[str]:
    """Language codes with a ``libreoffice-help-<code>`` package in the apt lists (plus ``en``)."""
    proc = _run(["apt-cache", "pkgnames", PACKAGE_PREFIX])
    if proc.returncode != 0:
        raise MoeLitError(f"apt-cache pkgnames failed: {_last_error_line(proc)}; {LOCAL_FOLDER_HINT}")
    suffixes = {name[len(PACKAGE_PREFIX) :] for name in proc.stdout.split()} - set(NOT_LANGUAGES)
    aliases = {short for short, full in ALIASES.items() if full in suffixes}
    return sorted(suffixes | aliases)


def download_and_extract(lang: str, workdir: Path) -> Path:
    """``apt-get download`` + ``dpkg -x`` into ``workdir``; returns the language's help folder."""
    package = package_name(lang)
    proc = _run(["apt-get", "download", package], cwd=workdir)
    debs = sorted(workdir.glob("*.deb"))
    if proc.returncode != 0 or not debs:
        raise MoeLitError(
            f"apt-get download {package} failed (offline or no such package?): {_last_error_line(proc)}; "
            f"{LOCAL_FOLDER_HINT}"
        )
    root = workdir / "root"
    proc = _run(["dpkg", "-x", str(debs[0]), str(root)])
    if proc.returncode != 0:
        raise MoeLitError(f"dpkg -x {debs[0].name} failed: {_last_error_line(proc)}")
    lang_dirs = sorted(path.parent for path in (root / HELP_ROOT).glob("*/text"))
    if len(lang_dirs) != 1:
        raise MoeLitError(f"{package}: expected one language folder /{HELP_ROOT}/*/text, found {len(lang_dirs)}")
    return lang_dirs[0]


def help_paragraphs(help_dir: Path, progress: bool = False) -> Iterator[Paragraph]:
    """Paragraphs of every help page under ``help_dir``, pages sorted by path."""
    from tqdm.auto import tqdm

    pages = sorted(help_dir.rglob("*.html"))
    # NOTE: disable=None: bars on a terminal only; in a log a nested bar writes cursor-up escapes.
    for page in tqdm(
        pages, desc=f"extract {help_dir.name}", unit="page", disable=None if progress else True, leave=False
    ):
        yield from page_paragraphs(page, page.relative_to(help_dir).as_posix())


def page_paragraphs(page: Path, doc: str) -> Iterator[Paragraph]:
    """Paragraphs and headings of one help page, with the platform-default text of switches."""
    import lxml.html

    tree = lxml.html.parse(str(page), lxml.html.HTMLParser(encoding="utf-8"))
    # NOTE: platform switches hold one hidden variant per OS (MAC, ...) that the page's script
    # reveals; keep the "default…" variant so a paragraph reads like the page on Linux.
    for element in tree.xpath("//*[@hidden]"):
        if not (element.get("id") or "").startswith("default"):
            element.drop_tree()
    for br in tree.iter("br"):
        br.tail = " " + (br.tail or "")
    seen: set[str] = set()
    elements = tree.xpath('//*[starts-with(@id, "par_id") or starts-with(@id, "hd_id")]')
    for pos, element in enumerate(elements):
        element_id = element.get("id")
        if element_id in seen or element.get("class") in SKIPPED_CLASSES:
            continue
        seen.add(element_id)
        yield Paragraph(f"{doc}#{element_id}", doc, pos, normalize(element.text_content()))


def cache_file(lang: str, cache_dir: Path) -> Path:
    """Where the extracted paragraphs of ``libreoffice-help-<lang>`` are cached."""
    return cache_dir / "debian" / f"{package_name(lang)}.jsonl"


def cached_paragraphs(lang: str, cache_dir: Path, progress: bool = False) -> list[Paragraph]:
    """Raw paragraphs of ``libreoffice-help-<lang>``: from the cache, else downloaded and extracted."""
    path = cache_file(lang, cache_dir)
    if path.is_file():
        with path.open(encoding="utf-8") as handle:
            return [Paragraph(**json.loads(line)) for line in handle]
    with tempfile.TemporaryDirectory(prefix=f"{package_name(lang)}.") as tmp:
        paragraphs = list(help_paragraphs(download_and_extract(lang, Path(tmp)), progress))
    atomic_write_text(path, "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in paragraphs))
    return paragraphs
