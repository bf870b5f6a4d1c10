"""What the studies share, so that no study imports another (the tools ``__main__``,
``report`` and ``demo`` still import studies by name):

- ``models``: every model a study runs (random weights, shapes only);
- ``comparison``: engines compared side by side on one request stream, stepped in turn
  (throughput, memory, block_size, gpu);
- ``sharing``: the sharing studies' workloads, roomy engines and memory-saved measure
  (beam, parallel, prefix, multiturn, eviction, memory);
- ``steps``: jitted pieces around a bare decode step (filled cache states, block management
  alone, a contiguous-cache decode) for the step-cost studies;
- ``timing``: decode step time vs batch, decode step times from an engine's timeline;
- ``ablations``: cost ablations registered as attention impls ("none").

A test swaps in a small model by patching the one module a study reads it from (e.g.
``monkeypatch.setattr(models, "llama_33m", tiny)``): studies call ``models.llama_33m(...)``
through the module, never a copy of the name.
"""
