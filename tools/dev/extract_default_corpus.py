#!/usr/bin/env python3
"""extract_default_corpus.py - the English text the default model (share/models/kiln-tiny) is
trained on: installs a few Debian packages with apt and extracts their text, one document per
chapter, section, dictionary entry or fortune cookie, into the git-ignored folder .corpus/.

    python3 tools/dev/extract_default_corpus.py [--out DIR] [--no-install]

Writes DIR/<source>.jsonl.xz (one JSON object per line: {"id": ..., "text": ...}, plus "term"
and "definition" for dictionary entries, which the training script may turn into chat turns)
and DIR/SOURCES.json (package, version, licence, documents and bytes of every source). Only
the Python standard library is used: this runs on the CPU machine, whose output is carried to
the GPU machine (tools/train_default_model.py). The output is deterministic for given package
versions: files are read in sorted order and xz is run at a fixed preset.

Sources (all with permissive licences or in the public domain; see SOURCES below):
  python    python3.11-doc  the Python documentation (reST sources)      PSF-2.0
  bible     sword-text-web  the World English Bible (modern English)     public domain
  wordnet   wordnet-base    WordNet 3.0 glosses and example sentences    WordNet 3.0 licence
  fortunes  fortunes        fortune cookies (quotations, jokes, poems)   BSD (4.4BSD-Lite)
  jargon    jargon-text     the Jargon File 4.4.7                        public domain
  devil     dict-devil      Ambrose Bierce, The Devil's Dictionary       public domain
"""
import argparse
import gzip
import html
import json
import lzma
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOURCES = {
    "python": {
        "package": "python3.11-doc",
        "what": "The Python 3.11 documentation (tutorial, library and language reference, "
        "HOWTOs, FAQs, What's New), from the reStructuredText sources the package ships",
        "license": "PSF-2.0 (Python Software Foundation License Version 2)",
    },
    "bible": {
        "package": "sword-text-web",
        "extra_packages": ["diatheke"],
        "what": "The World English Bible with Deuterocanon (engWEB2015eb), a modern-English "
        "translation, exported with diatheke; one document per chapter",
        "license": "public domain",
    },
    "wordnet": {
        "package": "wordnet-base",
        "what": "WordNet 3.0: every synset's words, part of speech, gloss and example sentences",
        "license": "WordNet 3.0 licence (permissive, BSD-like; keep the copyright notice)",
    },
    "fortunes": {
        "package": "fortunes",
        "what": "The fortune cookie files of fortune-mod (quotations, jokes, poems), without the "
        "ASCII-art files; one document per cookie",
        "license": "BSD (4.4BSD-Lite licence of fortune-mod); the cookies quote many authors",
    },
    "jargon": {
        "package": "jargon-text",
        "what": "The Jargon File 4.4.7 (hacker slang and folklore); one document per entry or "
        "chapter",
        "license": "public domain",
    },
    "devil": {
        "package": "dict-devil",
        "what": "Ambrose Bierce, The Devil's Dictionary (1911); one document per entry",
        "license": "public domain",
    },
}


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, **kw).stdout


def install(packages):
    missing = [p for p in packages if not pkg_version(p)]
    if not missing:
        return
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print("installing", " ".join(missing), flush=True)
    subprocess.run(sudo + ["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", "--no-install-recommends"] + missing,
                   check=True, env=env)


def pkg_version(p):
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status} ${Version}", p],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    parts = r.stdout.split()
    return parts[3] if r.returncode == 0 and len(parts) == 4 and parts[2] == "installed" else None


def clean(text):
    """Normalises whitespace: no trailing spaces, at most one blank line, no tabs."""
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    text = re.sub(r"[ \u00a0]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n").rstrip()


ITEM = re.compile(r"([*\-+\u2022]|#\.|\d+[.)]|[a-z][.)]) ")


def unwrap(text):
    """Joins the hard-wrapped lines of each paragraph: a line continues the one before when it
    starts at column 0 after a line at column 0, or lines up with the text of a list item
    above it. Other indented lines (verse, code, tables) are left alone."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        joined = []
        for ln in para.split("\n"):
            ind = len(ln) - len(ln.lstrip())
            if joined and ln.strip() and not ITEM.match(ln.lstrip()):
                prev = joined[-1]
                pind = len(prev) - len(prev.lstrip())
                pitem = ITEM.match(prev.lstrip())
                if (pitem and ind == pind + len(pitem.group(0))) or \
                        (not pitem and ind == 0 and pind == 0):
                    joined[-1] = prev.rstrip() + " " + ln.strip()
                    continue
            joined.append(ln)
        out.append("\n".join(joined))
    return "\n\n".join(out)


# ---- python: the reST sources of the Python documentation ----------------------------------

PY_DIR = "/usr/share/doc/python3.11/html/_sources"
PY_SKIP = {"license.rst.txt", "copyright.rst.txt", "contents.rst.txt", "bugs.rst.txt",
           "about.rst.txt", "includes"}
# Directives whose argument is the signature of what they describe (shown as a line).
PY_DESC = re.compile(r"(py:|c:|cpp:)?(function|method|classmethod|staticmethod|class|data|"
                     r"attribute|exception|decorator|decoratormethod|module|coroutinefunction|"
                     r"coroutinemethod|abstractmethod|opcode|envvar|cmdoption|option|describe|"
                     r"pdbcommand|type|macro|member|var|productionlist|term)$")
# Directives dropped with everything indented under them.
PY_DROP = re.compile(r"(index|highlight|toctree|testsetup|testcleanup|currentmodule|moduleauthor|"
                     r"sectionauthor|raw|image|figure|literalinclude|include|tabularcolumns|"
                     r"only|audit-event|audit-event-table|csv-table|list-table|table|"
                     r"program|miscnews|c:namespace|c:namespace-push|c:namespace-pop|"
                     r"limited-api-list|rubric|centered|hlist|graphviz|digraph|doctest-skip|"
                     r"availability|impl-detail-skip|deprecated-removed-skip|"
                     r"manpage|default-role|role|include-raw)$")
PY_VERSION = {"versionadded": "New in version {}.", "versionchanged": "Changed in version {}.",
              "deprecated": "Deprecated since version {}.",
              "deprecated-removed": "Deprecated since version {}."}
PY_CODE = re.compile(r"(code-block|code|sourcecode|doctest|testcode|testoutput|parsed-literal)$")


def rst_inline(s):
    def role(m):
        inner = m.group(2)
        t = re.match(r"(.*?)\s*<[^<>]*>$", inner, re.S)
        if t and t.group(1):
            return t.group(1)
        if inner.startswith("~"):
            return inner[1:].split(".")[-1]
        return inner.lstrip("!")
    s = re.sub(r":([\w:+-]+):`([^`]*)`", role, s)
    s = re.sub(r"``(.+?)``", r"\1", s)
    s = re.sub(r"`([^`<]*?)\s*<[^`>]*>`__?", r"\1", s)
    s = re.sub(r"`([^`]+)`__?", r"\1", s)
    s = re.sub(r"`([^`]+)`", r"\1", s)
    s = re.sub(r"\s?\[(#\w*|\d+)\]_", "", s)
    s = re.sub(r"\|(\w[\w ]*)\|", r"\1", s)
    s = re.sub(r"\*\*(\S(?:.*?\S)?)\*\*", r"\1", s)
    s = re.sub(r"(?<![\w*\\])\*(\S(?:[^*]*?\S)?)\*(?![\w*])", r"\1", s)
    s = s.replace("\\ ", "").replace("\\*", "*").replace("\\_", "_").replace("\\\\", "\\")
    return s


def rst_to_text(src):
    """reST -> plain text, roughly as Sphinx renders it. Returns [(title, text)] sections."""
    lines = src.split("\n")
    out = []      # (kind, line): kind "text", "code" or "title"
    i = 0
    n = len(lines)
    literal_next = None  # the indentation of a paragraph that ended with '::'

    while i < n:
        ln = lines[i]
        m = re.match(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$", ln)
        if m:
            ind, name, arg = len(m.group(1)), m.group(2), m.group(3)
            j = i + 1
            while j < n and re.match(r"^\s+:[\w-]+:", lines[j]) and \
                    len(lines[j]) - len(lines[j].lstrip()) > ind:
                j += 1  # directive options
            body_end = j
            while body_end < n and (not lines[body_end].strip() or
                                    len(lines[body_end]) - len(lines[body_end].lstrip()) > ind):
                body_end += 1
            if PY_DROP.match(name):
                i = body_end
                continue
            if name in PY_VERSION:
                head = PY_VERSION[name].format(arg.split()[0] if arg else "")
                out.append(("text", " " * ind + head))
            elif PY_DESC.match(name):
                if arg:
                    out.append(("text", ""))
                    out.append(("text", " " * ind + rst_inline(arg)))
            elif name in ("note", "warning", "seealso", "attention", "caution", "danger",
                          "important", "tip", "hint", "impl-detail", "admonition", "topic",
                          "sidebar", "epigraph"):
                label = {"note": "Note:", "warning": "Warning:", "seealso": "See also:",
                         "impl-detail": "CPython implementation detail:"}.get(name)
                if label or arg:
                    out.append(("text", " " * ind + " ".join(x for x in (label, rst_inline(arg))
                                                             if x)))
            elif PY_CODE.match(name):
                out.append(("text", ""))
                for k in range(j, body_end):
                    out.append(("code", lines[k]))
                i = body_end
                continue
            # else: an unknown directive: keep its body as text
            i = j
            continue
        if re.match(r"^\s*\.\.\s+_[^:]*:\s*(\S.*)?$", ln) or re.match(r"^\s*\.\.\s+\|", ln) \
                or re.match(r"^\s*\.\.\s+\[", ln):
            i += 1  # label, substitution definition, footnote
            continue
        if re.match(r"^\s*\.\.(\s|$)", ln):
            ind = len(ln) - len(ln.lstrip())  # a comment: drop it and its indented body
            j = i + 1
            while j < n and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > ind):
                j += 1
            i = j
            continue
        # section titles: a line underlined (optionally also overlined) by punctuation
        if re.match(r"^([=\-~^\"'*#+`:.])\1{2,}\s*$", ln):
            i += 1
            continue
        if (ln.strip() and i + 1 < n and re.match(r"^([=\-~^\"'*#+`:.])\1{2,}\s*$", lines[i + 1])
                and len(lines[i + 1].rstrip()) >= len(ln.rstrip()) - 1 and not ln.startswith(" ")):
            out.append(("title", rst_inline(ln.strip())))
            i += 2
            continue
        indent = len(ln) - len(ln.lstrip())
        if literal_next is not None and (not ln.strip() or indent > literal_next):
            # the indented block after '::': lines indented deeper than the '::' paragraph
            j = i
            while j < n and (not lines[j].strip() or
                             len(lines[j]) - len(lines[j].lstrip()) > literal_next):
                out.append(("code", lines[j]))
                j += 1
            literal_next = None
            i = j
            continue
        literal_next = None
        if re.match(r"^\s*\+[-=+]+\+\s*$", ln) or re.match(r"^\s*=+( +=+)+\s*$", ln):
            # a grid or simple table: kept as preformatted lines, without its borders
            j = i
            while j < n and lines[j].strip():
                if not re.match(r"^\s*(\+[-=+]+\+|=+( +=+)*|-+( +-+)+)\s*$", lines[j]):
                    out.append(("code", rst_inline(lines[j])))
                j += 1
            i = j
            continue
        text = ln
        if text.rstrip().endswith("::"):
            literal_next = indent
            s = text.rstrip()[:-2].rstrip()
            text = "" if not s.strip() else (s if s.endswith(" ") or s.endswith(":")
                                             else s + ":")
        out.append(("text", text))
        i += 1
    # group into sections at titles; dedent code blocks; unwrap, dedent and de-markup prose
    sections = []
    title, blocks, para, code = None, [], [], []

    def flush_para():
        if para:
            ind = min(len(x) - len(x.lstrip()) for x in para)
            text = "\n".join(x[ind:] for x in para)
            blocks.append(rst_inline(unwrap(text)))
            para.clear()

    def flush_code():
        if code:
            body = [c for c in code]
            while body and not body[-1].strip():
                body.pop()
            while body and not body[0].strip():
                body.pop(0)
            if body:
                ind = min(len(c) - len(c.lstrip()) for c in body if c.strip())
                blocks.append("\n".join(c[ind:] for c in body))
            code.clear()

    def flush_section():
        flush_para()
        flush_code()
        text = clean("\n\n".join(b for b in blocks if b.strip()))
        if title:
            text = clean(title + "\n\n" + text)
        if text:
            sections.append(text)

    for kind, ln in out:
        if kind == "code":
            flush_para()
            code.append(ln)
            continue
        flush_code()
        if kind == "title":
            flush_section()
            title, blocks = ln, []
        elif not ln.strip():
            flush_para()
        else:
            para.append(ln)
    flush_section()
    return sections


def extract_python():
    docs = []
    for dirpath, dirnames, filenames in os.walk(PY_DIR):
        dirnames[:] = sorted(d for d in dirnames if d not in PY_SKIP)
        for f in sorted(filenames):
            if not f.endswith(".rst.txt") or f in PY_SKIP:
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, PY_DIR)[:-len(".rst.txt")]
            with open(path, encoding="utf-8") as fh:
                sections = rst_to_text(fh.read())
            # merge short sections into the next so that a document has some substance
            pending = ""
            k = 0
            for s in sections:
                pending = (pending + "\n\n" + s) if pending else s
                if len(pending) >= 400:
                    docs.append({"id": f"{rel}#{k}", "text": pending})
                    k += 1
                    pending = ""
            if pending:
                if docs and docs[-1]["id"].startswith(rel + "#"):
                    docs[-1]["text"] += "\n\n" + pending
                else:
                    docs.append({"id": f"{rel}#{k}", "text": pending})
    return docs


# ---- bible: the World English Bible through diatheke ----------------------------------------

def extract_bible():
    raw = sh(["diatheke", "-b", "engWEB2015eb", "-f", "internal", "-k", "Gen-Rev"],
             stderr=subprocess.DEVNULL).decode("utf-8")
    raw = raw.replace("(engWEB2015eb)", "")
    gloss = raw.find("The following words used in the World English Bible")
    glossary = raw[gloss:] if gloss >= 0 else ""
    if gloss >= 0:
        raw = raw[:gloss]
    pat = re.compile(r"((?:I{1,3} |IV )?[A-Z][A-Za-z ]*?) (\d+):(\d+): ")
    ms = list(pat.finditer(raw))
    chapters = {}
    order = []
    for k, m in enumerate(ms):
        seg = raw[m.end():ms[k + 1].start() if k + 1 < len(ms) else len(raw)]
        seg = re.sub(r"<title[^>]*>.*?</title>", " ", seg, flags=re.S)
        seg = re.sub(r"<note[^>]*>.*?</note>", " ", seg, flags=re.S)
        seg = seg.replace("</w><w", "</w> <w")
        seg = re.sub(r"<[^>]*>", "", seg)
        seg = html.unescape(seg)
        seg = re.sub(r"\s+", " ", seg).strip()
        key = (m.group(1), int(m.group(2)))
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        if seg:
            chapters[key].append(seg)
    docs = []
    for book, ch in order:
        text = " ".join(chapters[(book, ch)])
        text = re.sub(r" +([,.;:!?’”])", r"\1", text)
        if text:
            docs.append({"id": f"{book} {ch}", "text": f"{book} {ch}\n\n{text}"})
    glossary = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]*>", "", glossary))).strip()
    if glossary:
        docs.append({"id": "glossary", "text": glossary})
    return docs


# ---- wordnet: glosses ------------------------------------------------------------------------

WN_POS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}


def extract_wordnet():
    docs = []
    for part in ("noun", "verb", "adj", "adv"):
        with open(f"/usr/share/wordnet/data.{part}", encoding="utf-8", errors="replace") as fh:
            for ln in fh:
                if ln.startswith("  ") or "|" not in ln:
                    continue
                head, gloss = ln.split("|", 1)
                f = head.split()
                offset, pos, cnt = f[0], f[2], int(f[3], 16)
                words = []
                for w in f[4:4 + 2 * cnt:2]:
                    w = re.sub(r"\((a|p|ip)\)$", "", w).replace("_", " ")
                    if w not in words:
                        words.append(w)
                gloss = gloss.strip()
                # gloss; "example"; "example"
                defs, examples = [], []
                for piece in re.split(r";\s*(?=\")|(?<=\");\s*", gloss):
                    piece = piece.strip().strip(";").strip()
                    if piece.startswith('"'):
                        examples.append(piece.strip('"').strip())
                    elif piece:
                        defs.append(piece)
                definition = "; ".join(defs)
                if definition:
                    definition = definition[0].upper() + definition[1:]
                    if not definition.endswith((".", "!", "?")):
                        definition += "."
                for e in examples:
                    if e:
                        e = e[0].upper() + e[1:]
                        definition += f' For example: "{e}"' if e.endswith((".", "!", "?")) \
                            else f' For example: "{e}."'
                text = f"{', '.join(words)} ({WN_POS[pos]}): {definition}"
                docs.append({"id": f"{part}.{offset}", "text": text, "term": words[0],
                             "definition": definition})
    return docs


# ---- fortunes ---------------------------------------------------------------------------------

FORTUNE_DIR = "/usr/share/games/fortunes"
FORTUNE_SKIP = {"art", "ascii-art", "translate-me"}


def extract_fortunes():
    docs = []
    for f in sorted(os.listdir(FORTUNE_DIR)):
        path = os.path.join(FORTUNE_DIR, f)
        if "." in f or f in FORTUNE_SKIP or not os.path.isfile(path):
            continue
        with open(path, "rb") as fh:
            data = fh.read().decode("utf-8", errors="replace")
        data = re.sub(r".\x08", "", data)  # overstriking (underline, bold)
        for k, cookie in enumerate(re.split(r"\n%\n", data)):
            cookie = clean(cookie.strip("%\n"))
            if len(cookie) >= 8:
                docs.append({"id": f"{f}.{k}", "text": cookie})
    return docs


# ---- jargon -------------------------------------------------------------------------------------

def extract_jargon():
    with gzip.open("/usr/share/doc/jargon-text/jargon.txt.gz", "rt", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "Welcome to the Jargon File"
                 and ln.startswith("    "))
    docs = []
    cur_id, cur_term, cur = None, None, []

    def flush():
        if cur_id and cur_id != "Bibliography":
            body = [ln[3:] if ln.startswith("   ") else ln for ln in cur]
            text = clean(unwrap(re.sub(r"\{([^{}]*)\}", r"\1", "\n".join(body))))
            if len(text) > 40:
                d = {"id": cur_id, "text": text}
                if cur_term:
                    first = text.split("\n", 1)
                    definition = first[1].strip() if len(first) > 1 else ""
                    if definition:
                        d["term"], d["definition"] = cur_term, definition
                docs.append(d)

    for ln in lines[start:]:
        m = re.match(r"^   :([^:]+):(.*)$", ln)
        if m:
            flush()
            cur_id, cur_term = m.group(1), m.group(1)
            rest = m.group(2).strip()
            cur = [f"{m.group(1)}" + (f" ({rest.rstrip('.')})" if rest else "")]
            continue
        if re.match(r"[A-Za-z0-9]", ln) or \
                re.match(r"^ {20,}(Welcome to the Jargon File|Part [IVX]+\. .*)$", ln):
            flush()  # a heading: at column 0, or centred
            cur_id, cur_term, cur = ln.strip(), None, [ln.strip()]
            continue
        if ln.startswith("   ═"):
            continue
        cur.append(ln)
    flush()
    # the table of contents and the glossary heading carry no text
    return [d for d in docs if d["id"] not in ("Glossary",)]


# ---- devil -----------------------------------------------------------------------------------------

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64(s):
    v = 0
    for c in s:
        v = v * 64 + B64.index(c)
    return v


def extract_devil():
    with gzip.open("/usr/share/dictd/devil.dict.dz", "rb") as fh:
        data = fh.read()
    docs = []
    with open("/usr/share/dictd/devil.index", encoding="utf-8") as fh:
        entries = [ln.rstrip("\n").split("\t") for ln in fh]
    seen = set()
    for word, off, length in sorted(entries, key=lambda e: b64(e[1])):
        if word.startswith("00database") or (off, length) in seen:
            continue
        seen.add((off, length))
        text = data[b64(off):b64(off) + b64(length)].decode("utf-8", errors="replace")
        lines = text.split("\n")
        if lines and lines[0].strip().upper() == word.upper():
            lines = lines[1:]  # dictfmt repeats the headword on its own line
        text = clean(unwrap(re.sub(r"_([^_]+)_", r"\1", "\n".join(lines))))
        m = re.match(r"([A-Z][A-Z '\-]*), (\w+\.)\s+(.*)", text, re.S)
        d = {"id": word, "text": text}
        if m:
            d["term"] = m.group(1).lower() if m.group(1).isupper() else m.group(1)
            d["definition"] = m.group(3).strip()
        docs.append(d)
    return docs


EXTRACT = {"python": extract_python, "bible": extract_bible, "wordnet": extract_wordnet,
           "fortunes": extract_fortunes, "jargon": extract_jargon, "devil": extract_devil}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, ".corpus"))
    ap.add_argument("--no-install", action="store_true", help="do not call apt-get")
    args = ap.parse_args()
    pkgs = []
    for s in SOURCES.values():
        pkgs += [s["package"]] + s.get("extra_packages", [])
    if not args.no_install:
        install(pkgs)
    os.makedirs(args.out, exist_ok=True)
    meta = {"sources": {}}
    for name, src in SOURCES.items():
        docs = EXTRACT[name]()
        ids = set()
        for d in docs:  # ids must be unique: the train/held-out split hashes them
            base, k = d["id"], 1
            while d["id"] in ids:
                k += 1
                d["id"] = f"{base}~{k}"
            ids.add(d["id"])
        path = os.path.join(args.out, f"{name}.jsonl.xz")
        payload = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs)
        raw = payload.encode("utf-8")
        with lzma.open(path + ".tmp", "wb", preset=9) as fh:
            fh.write(raw)
        os.replace(path + ".tmp", path)
        nbytes = sum(len(d["text"].encode("utf-8")) for d in docs)
        meta["sources"][name] = dict(src, version=pkg_version(src["package"]), documents=len(docs),
                                     text_bytes=nbytes, file=os.path.basename(path),
                                     file_bytes=os.path.getsize(path))
        print(f"{name:9s} {src['package']:15s} {meta['sources'][name]['version']:22s} "
              f"{len(docs):7d} docs {nbytes / 1e6:7.2f} MB text "
              f"{os.path.getsize(path) / 1e6:6.2f} MB xz", flush=True)
    with open(os.path.join(args.out, "SOURCES.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
