"""The compile-mode matrix's table (markdown) from the JSON files test_gpu_compile_matrix.py
writes under TORCHFUSE_TEST_RECORD_DIR:

  python3 scripts/bench/compile_matrix_table.py DIR/compile-matrix-*.json
"""
import json
import sys
from pathlib import Path


def rows(path):
    model = Path(path).stem.split("compile-matrix-")[-1]
    sides = json.loads(Path(path).read_text())
    for mode, stock in sides["stock"].items():
        ours = sides["torchfuse"][mode]
        if "error" in stock or "error" in ours:
            yield f"| {model} | {mode} | {stock.get('error', '')[:60]} | {ours.get('error', '')[:60]} | error | | |"
            continue
        diff = max(abs(a - b) for a, b in zip(stock["losses"], ours["losses"]))
        losses = [" ".join(f"{x:.4f}" for x in side["losses"]) for side in (stock, ours)]
        yield (f"| {model} | {mode} | {losses[0]} | {losses[1]} | {diff:.1e} | "
               f"{stock['seconds']:.1f} | {ours['seconds']:.1f} |")


def main():
    print("| model | mode | stock losses | torchfuse losses | max abs diff | stock s | torchfuse s |")
    print("|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        for row in rows(path):
            print(row)


if __name__ == "__main__":
    main()
