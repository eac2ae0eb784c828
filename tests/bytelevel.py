"""bytelevel.py - GPT-2's byte-level alphabet, shared by the test scripts that write byte-level
BPE tokenizers (make_gguf_vocab.py, server/make_tool_model.py, server/make_vl_model.py,
fuzz/make_seeds.py)."""


def byte_level_alphabet():
    """byte -> the character standing for it: printable Latin-1 bytes for themselves, the rest
    shifted past 255 in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table
