"""The engine side inside vLLM 0.33: the ``weight_cache`` load format.

- :mod:`.loader`: the loader vLLM registers (``WeightCacheModelLoader``) and its
  before-window hook;
- :mod:`.load_steps`: the attach as named steps (``LOAD_STEPS``) on one :class:`~.load_steps.Load`;
- :mod:`.steps`: running named steps, timed, each failure typed;
- :mod:`.engine_start`: what an engine start learns before it attaches (the checkpoint's
  identity, read once; the daemon's model);
- :mod:`.kernel_check`: the FP8 layers must be on the kernel the daemon processed for;
- :mod:`.binding`: leased tensors become vLLM's parameters;
- :mod:`.runtime_state`: what vLLM's constructors compute, built on the target device;
- :mod:`.internals`: every touch of vLLM's internals, each tested in
  ``tests/vllm/test_internals.py``.

Nothing here is imported until vLLM loads the plugin (:mod:`engine_client.vllm_plugin`).
"""
