"""The GPU run scripts' CPU dry runs, so that a script waiting for a machine kind that is not lent
(tools/gpu_full_node.sh: issue #15's 8-GPU node) does not rot unseen: the same parts, with the tiny
model on 8 processes under mpirun --oversubscribe, must end with PASS.
"""
import argparse
import os
import subprocess
import sys
import tempfile


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, DRY_RUN="1", MARROW=os.path.abspath(args.marrow), PYTHON=sys.executable)
        p = subprocess.run([os.path.join(repo, "tools", "gpu_full_node.sh"), os.path.join(tmp, "logs"), "all"], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=900)
        print(p.stdout[-3000:], p.stderr[-2000:])
        ok = p.returncode == 0 and p.stdout.strip().endswith("PASS") and "equal sha256: True" in p.stdout
        print("ok      " if ok else "FAILED  ", "tools/gpu_full_node.sh's dry run: train, resume bit for bit, export")
        print("PASS" if ok else "FAIL")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
