"""Build hook for the optional C kernel (everything else is configured in pyproject.toml).

``trie_decode._kernel`` is the fused CPU masking step (trie_decode/_kernel.c). It is optional: where no C compiler
is available the install still succeeds and ``trie_decode.kernels`` falls back to the numpy/torch kernel.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trie_decode._kernel",
            ["trie_decode/_kernel.c"],
            extra_compile_args=["-O3", "-std=c99"],
            optional=True,
        )
    ]
)
