"""boost in the trainers people already use: Hugging Face Trainer and accelerate
(:mod:`boost_compile.integrations.hf`) and Lightning (:mod:`boost_compile.integrations.lightning`).

Each module imports its framework only when used; the frameworks are optional extras
(``pip install 'boost-compile[hf]'``, ``'boost-compile[lightning]'``).
"""
