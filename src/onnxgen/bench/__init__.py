"""The benchmark harness behind ``onnxgen bench``.

- :mod:`.harness`: the parent: starts one worker process per engine (or decode plan), runs them
  interleaved and builds the report (:func:`~onnxgen.bench.harness.run_bench`);
- :mod:`.worker`: the worker process and its JSON-line protocol;
- :mod:`.onnxgen_engine` / :mod:`.genai_engine`: each engine's side inside its worker (onnxgen's forwards
  are timed through the session's forward observer, :mod:`onnxgen.runtime.observer`);
- :mod:`.prompts`, :mod:`.constraints`: what is timed; :mod:`.stats`: medians, pairings and ratios;
- :mod:`.pool`: pools the reports of several commands (``python -m onnxgen.bench.pool``);
- :mod:`.prefix`: ``onnxgen bench --prefix-cache``;
- :mod:`.workloads`, :mod:`.workload_engines`, :mod:`.workload_run`: ``onnxgen bench --workload``: a chat,
  code edits and questions over a document, against ``onnxgen serve``, onnxruntime-genai and llama.cpp.

This package imports nothing itself: a worker imports only what its engine's user would.
"""
