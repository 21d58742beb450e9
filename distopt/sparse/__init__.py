"""Embedding tables sharded over RPC workers, and optimizers that update only the rows used.

``ShardedEmbedding`` splits a table's rows over owner workers and looks rows up with one
RPC per owner; its backward pass sends each owner only its rows' gradients. ``SparseSGD``,
``SparseAdagrad`` and ``SparseAdam`` update, on each owner, the rows a step's gradient
holds, with torch.optim's semantics on one ``nn.Embedding(sparse=True)`` (or DGL's
averaging of repeated rows): a table steps as one parameter, its step counts advancing on
every owner whenever it gets a gradient (see ``distopt.sparse.optimizers``).
``RowWiseAdagrad`` and ``PartialRowWiseAdam`` keep fbgemm's row-wise state (one second
moment per row) with fbgemm's rules.
"""
from distopt.sparse.embedding import ShardedEmbedding
from distopt.sparse.optimizers import (
    PartialRowWiseAdam,
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
)

# In the order a newcomer reads them (the API page follows it): the table, then its
# optimizers as the sparse guide lists them.
__all__ = [
    "ShardedEmbedding",
    "SparseSGD",
    "SparseAdagrad",
    "SparseAdam",
    "RowWiseAdagrad",
    "PartialRowWiseAdam",
]
