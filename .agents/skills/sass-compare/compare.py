"""Compares two cuobjdump -sass listings function by function (addresses and encodings left out).
Prints each function as identical, or the instruction counts that differ; exits 1 unless all are the
same. Used by run.sh."""
import collections
import re
import sys


def functions(path):
    parts = re.split(r"\n\s*Function : (\S+)\n", open(path).read())
    # An anonymous namespace's mangled name holds a hash of the file's path, which differs between trees.
    return {re.sub(r"_GLOBAL__N__(?:\d+_[A-Za-z0-9_]*?_)?[0-9a-f]{8}_?", "_GLOBAL__N__", parts[i]): [re.sub(r"/\*.*?\*/", "", line).strip() for line in parts[i + 1].split("\n")
                       if re.match(r"\s*/\*[0-9a-f]{4}\*/", line)] for i in range(1, len(parts), 2)}


def opcodes(code):
    words = [line.rstrip(" ;").split() for line in code if line.rstrip(" ;")]
    return collections.Counter(w[1] if w[0].startswith("@") else w[0] for w in words)


base, tree = functions(sys.argv[1]), functions(sys.argv[2])
same = True
for name in sorted(set(base) | set(tree)):
    short = name[:90]
    if name not in base or name not in tree:
        print(f"{short}: only in the {'tree' if name in tree else 'base'}")
        same = False
    elif base[name] == tree[name]:
        print(f"{short}: identical ({len(tree[name])} instructions)")
    else:
        b, t = opcodes(base[name]), opcodes(tree[name])
        changed = {op: (b[op], t[op]) for op in sorted(set(b) | set(t)) if b[op] != t[op]}
        print(f"{short}: differs, {len(base[name])} -> {len(tree[name])} instructions; opcodes (base, tree): {changed or 'same counts, other order or operands'}")
        same = False
print("PASS" if same else "FAIL")
sys.exit(0 if same else 1)
