import dataclasses

import numpy as np

from turnip.memgraph.plan import csr


def edit_deps(mg, fn):
    """A copy of ``mg`` whose dependency lists were changed by ``fn(list of [(src, kind)])``."""
    deps = [
        list(zip(mg.deps(v).tolist(), mg.dep_kind[mg.dep_ptr[v] : mg.dep_ptr[v + 1]].tolist(), strict=True))
        for v in range(mg.n)
    ]
    fn(deps)
    ptr, src = csr([[s for s, _ in d] for d in deps])
    _, kind = csr([[k for _, k in d] for d in deps], dtype=np.int8)
    return dataclasses.replace(mg, dep_ptr=ptr, dep_src=src, dep_kind=kind, _succ=None)
