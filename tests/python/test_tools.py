"""The GPU run scripts' CPU dry runs, so that a script waiting for a machine kind that is not lent
does not rot unseen: tools/gpu_full_node.sh (issue #15's 8-GPU node) on 8 processes, and
tools/gpu_pipeline.sh (#12) and tools/gpu_context.sh (#13) on 2, under mpirun --oversubscribe with the
tiny model, must end with PASS and print the comparisons they exist for (gpu_context.sh's check part with tiny
Qwen3.5-MoE too: the sequence chain's CP = 2 against one process), as must tools/gpu_family.sh's
bench part (#50, #53: marrow bench and its PyTorch peer, reference_run.py bench) in one CPU process, for
DeepSeek-V2 and Qwen3.5-MoE. And
tools/ncu_stalls.py, which reads Nsight Compute's source page on the GPU machine, on a small page of known shares.
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
        # (script, its arguments after the log directory, lines its output must hold besides PASS, what the run shows)
        runs = [("gpu_full_node.sh", ["all"], ["equal sha256: True"], "train, resume bit for bit, export"),
                ("gpu_pipeline.sh", ["one"], ["equal: True"], "one process, the DualPipeV order's losses equal the sequential's"),
                ("gpu_pipeline.sh", ["all"], ["equal: True", "simulated bubble", "PP = 2: "], "EP = 2 orders equal, PP = 2 trains"),
                ("gpu_context.sh", ["all"], ["the bench config at sequence 512 with CP = 2", "sequence 1024 fits"],
                 "CP = 2 against one process, the long run, the largest sequences"),
                ("gpu_context.sh", ["check"], ["the bench config at sequence 256, 6 steps"],
                 "CP = 2 against one process, tiny Qwen3.5-MoE (CP_TINY)", {"CP_TINY": "configs/tiny-qwen3-5-moe.toml"}),
                ("gpu_family.sh", ["deepseek-v2", "bench"], ["summary: marrow", "marrow losses", "torch eager losses"],
                 "marrow bench and reference_run.py bench of tiny DeepSeek-V2, the summary"),
                ("gpu_family.sh", ["qwen3-5-moe", "bench"], ["summary: marrow", "marrow losses", "torch eager losses"],
                 "marrow bench and reference_run.py bench of tiny Qwen3.5-MoE, the summary")]
        ok = True
        for i, (script, parts, want, what, *extra_env) in enumerate(runs):
            part = " ".join(parts)
            p = subprocess.run([os.path.join(repo, "tools", script), os.path.join(tmp, f"{i}-{script}-" + "-".join(parts)), *parts], cwd=repo,
                               env=dict(env, **(extra_env[0] if extra_env else {})), capture_output=True, text=True, timeout=900)
            print(p.stdout[-3000:], p.stderr[-2000:])
            this_ok = p.returncode == 0 and p.stdout.strip().endswith("PASS") and all(w in p.stdout for w in want)
            print("ok      " if this_ok else "FAILED  ", f"tools/{script} {part}'s dry run: {what}")
            ok = ok and this_ok
        stalls_ok = check_ncu_stalls(repo, tmp)
        print("ok      " if stalls_ok else "FAILED  ", "tools/ncu_stalls.py: shares by reason, opcode and run")
        print("PASS" if ok and stalls_ok else "FAIL")
        sys.exit(0 if ok and stalls_ok else 1)


def check_ncu_stalls(repo, tmp):
    """Three instructions with 30, 10 and 60 samples: the shares must come out as such."""
    page = os.path.join(tmp, "sass.csv")
    with open(page, "w") as f:
        f.write('"Kernel Name","k"\n')
        f.write('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_lg","stall_wait",'
                '"stall_lg (Not Issued)"\n')
        f.write('"0x10","LDG.E R2, [R4]","30","8","30","0","30"\n')
        f.write('"0x20","@!P0 STG.E [R4], R2","10","8","0","10","0"\n')
        f.write('"0x30","HGMMA.64x256x16.F32 R24, gdesc[UR4], R24","60","100","0","60","0"\n')
    p = subprocess.run([sys.executable, os.path.join(repo, "tools", "ncu_stalls.py"), page, "--runs", "2"], capture_output=True,
                       text=True, timeout=60)
    print(p.stdout, p.stderr)
    want = ["100 samples over 3 instructions", "wait                    70.0%", "lg                      30.0%",
            "HGMMA         60.0%", "STG           10.0%", "0  40.0%", "2  60.0%"]
    return p.returncode == 0 and all(w in p.stdout for w in want)


if __name__ == "__main__":
    main()
