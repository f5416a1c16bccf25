"""Processing checkpoints for vLLM's CUTLASS FP8 kernel, byte-identical to vLLM 0.33.

The building blocks (:mod:`.tensor_spec`, :mod:`.rows`, :mod:`.fp8`, :mod:`.cutlass`,
:mod:`.source`) import nothing of the checkpoint reader, so the quantization schemes
(:mod:`modelopt_fp8.schemes`), which the checkpoint's config asks, can use them; the planner
(:mod:`.plan`) and the execution (:mod:`.execute`) come above both. This package re-exports
nothing: importing a building block must not import the planner.
"""
