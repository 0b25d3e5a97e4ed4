"""Plumbing that ftrain's modules share and users do not call: scoped values (``scoped``,
``func_scope``), ``torch._dynamo`` settings (``dynamo``), nn.Module's tables (``module_tables``),
multi-tensor kernels (``foreach``), block rewriting (``blocks``), keyed dropout, byte units, batch
rows and the version. Any ftrain module may import from here, private names included
(tests/test_structure.py allows exactly that); nothing here is public API.
"""
