"""Benchmark suites of deferred_grad: one module per suite (see benchmark.py).

Each suite module has `run()`, returning (results dict, Markdown table), and,
where it measures in fresh processes, `child(spec)`, which the entry point
calls when started with `--child=SUITE:SPEC` (see `common.run_child`).
"""
