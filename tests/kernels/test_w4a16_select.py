"""The W4A16 selection (kernels/w4a16_select.py): the shipped H200 table pinned for the Llama-3-8B and
benchmark shapes, the rules elsewhere, and the one capability check. CPU only: selection is a pure function."""

from __future__ import annotations

import json

import pytest

from quantkit.kernels.w4a16_configs import (
    PER_CHANNEL_GROUP,
    GemvConfig,
    GluonConfig,
    PairsConfig,
    TcConfig,
    config_from_dict,
    config_to_dict,
    kernel_group_size,
)
from quantkit.kernels.w4a16_select import (
    TABLE_PATH,
    LayerFacts,
    facts_of,
    load_table,
    m_bucket,
    plan_w4a16,
    select_w4a16,
    w4a16_supports,
)

G = GluonConfig
# (N, K, M) -> the kernel and config the shipped H200 table gives (sym, group 128). Regenerate with
# bench/tune_w4a16.py on the GPU; a changed table must change this list too.
PINNED_SM90 = {
    (4096, 4096, 1): ("gluon", G(128, 16, 1, 4, 4, DIRECT=True)),
    (4096, 4096, 4): ("gluon", G(128, 16, 1, 4, 4, DIRECT=True, UNROLL=2)),  # re-tuned 2026-12-03 (was 8.2 us)
    (4096, 4096, 16): ("gluon", G(128, 16, 4, 4, 2, X_BOX_K=64)),
    (4096, 4096, 2048): ("gluon", G(256, 128, 4, 8, WGMMA=True, STREAM_K=False, PERSISTENT=True)),
    (6144, 4096, 1): ("gluon", G(256, 16, 1, 8, 2, DIRECT=True)),
    (6144, 4096, 16): ("gluon", G(128, 16, 4, 4, 2, X_BOX_K=64)),
    (6144, 4096, 2048): ("gluon", G(256, 128, 4, 8, WGMMA=True, STREAM_K=False, PERSISTENT=True)),
    (28672, 4096, 1): ("gluon", G(256, 16, 4, 4, 2, X_BOX_K=64)),
    (28672, 4096, 16): ("gluon", G(128, 16, 4, 4, 2, X_BOX_K=64)),
    (28672, 4096, 2048): ("gluon", G(256, 128, 4, 8, WGMMA=True, STREAM_K=False, PERSISTENT=True)),
    (4096, 14336, 1): ("gluon", G(256, 16, 1, 8, 2, DIRECT=True, GATHER_X=True)),
    (4096, 14336, 16): ("gluon", G(128, 16, 4, 4, 2, X_BOX_K=64)),
    (4096, 14336, 2048): ("gluon", G(256, 128, 4, 8, WGMMA=True, STREAM_K=False)),
    (28672, 8192, 1): ("gluon", G(256, 16, 4, 4, 2, X_BOX_K=64)),
    (28672, 8192, 4096): ("gluon", G(256, 128, 4, 8, WGMMA=True, STREAM_K=False)),
    (8192, 28672, 64): ("gluon", G(128, 64, 6, 8, WGMMA=True, STREAM_K=True)),
    (576, 1536, 1): ("gemv", GemvConfig(8, 1024, 4, PIPE=4, SPLIT_K=1)),  # tuned GEMV: one row, small layer
}


@pytest.mark.parametrize("n,k,m", list(PINNED_SM90))
def test_the_h200_table_is_pinned(n, k, m):
    choice = select_w4a16(m, facts_of(n, k, 4, 128, True, False), "sm90")
    assert (choice.kernel, choice.config) == PINNED_SM90[(n, k, m)], choice.reason


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 64, 100, 333, 2048, 5000])
@pytest.mark.parametrize("n,k,gs", [(6144, 4096, 128), (1000, 3072, 64), (4096, 4096, -1), (128, 256, 32)])
def test_every_gluon_pick_fits_every_m_of_its_bucket(n, k, gs, m):
    facts = facts_of(n, k, 4, gs, False, True)
    choice = select_w4a16(m, facts, "sm90")
    if choice.kernel == "gluon":
        assert choice.config.fits(m, facts.group_size), choice
        assert not choice.config.DIRECT or facts.direct
    else:
        assert choice.kernel == "gemv" and m == 1  # the GEMV keeps one row on small layers


def test_rules_off_hopper_and_outside_the_paired_layout():
    def pick(m, n, k, bits=4, gs=128, arch="sm80"):
        c = select_w4a16(m, facts_of(n, k, bits, gs, True, False), arch)
        return c.kernel, c.config

    # one row: the GEMV, direct store up to 16 M weights, split K above
    assert pick(1, 4096, 4096) == ("gemv", GemvConfig(8, 512, 4, PIPE=3, SPLIT_K=1))
    assert pick(1, 28672, 4096) == ("gemv", GemvConfig(128, 128, 4))
    # two rows: the GEMV below 32 M weights, the paired kernel above
    assert pick(2, 4096, 4096)[0] == "gemv" and pick(2, 28672, 4096)[0] == "pairs"
    assert pick(16, 4096, 4096) == ("pairs", PairsConfig(128, 16, 4, 3))
    assert pick(2048, 4096, 4096) == ("pairs", PairsConfig(128, 128, 8, 3))
    # 8-bit codes and K off the 128-code tile: the general tensor-core kernel, also on Hopper
    for arch in ("sm80", "sm90"):
        assert pick(16, 4096, 4096, bits=8, arch=arch) == ("tc", TcConfig(64, 16, 256, 4, 3))
        assert pick(2048, 1536, 576, arch=arch)[0] == "tc"
    # Hopper, one row on a layer under 4 M weights: the GEMV (H200 runs 41, 43)
    assert pick(1, 576, 1536, arch="sm90")[0] == "gemv" and pick(2, 576, 1536, arch="sm90")[0] == "gluon"
    # a GEMV K tile must lie inside a group or cover whole ones
    kernel, config = pick(1, 1024, 960, gs=192)
    assert kernel != "gemv" or 192 % config.BLOCK_K == 0 or config.BLOCK_K % 192 == 0


def test_one_capability_check_with_reasons():
    facts = facts_of(4096, 4096, 4, 128, True, False)
    assert w4a16_supports(facts, "sm90") == (True, "")
    assert w4a16_supports(facts, None) == (False, "input is not on a CUDA device")
    assert "sm_80" in w4a16_supports(facts, "sm75")[1]
    assert "float32" in w4a16_supports(facts, "sm90", "torch.float32")[1]
    assert "3-bit" in w4a16_supports(facts_of(4096, 4096, 3, 128, True, False), "sm90")[1]
    irregular = LayerFacts(4096, 4096, 4, None, False, True)
    assert not w4a16_supports(irregular, "sm90")[0]
    assert select_w4a16(16, irregular, "sm90").kernel == "reference"


def test_per_channel_has_one_encoding_past_the_checkpoint():
    assert kernel_group_size(-1, 4096) == PER_CHANNEL_GROUP == kernel_group_size(4096, 4096)
    assert kernel_group_size(128, 4096) == 128
    assert facts_of(4096, 4096, 4, -1, True, False).group_size == PER_CHANNEL_GROUP


def test_plan_is_decided_once_per_bucket():
    facts = facts_of(4096, 4096, 4, 128, True, False)
    plan = plan_w4a16(facts, "sm90")
    assert plan is plan_w4a16(facts, "sm90")  # memoized: layers of one shape share it
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 4096, 10**6)] == [1, 2, 4, 4, 8, 4096, 4096]
    for m in (1, 7, 16, 300, 4096, 9000):
        assert plan.choice(m) == select_w4a16(m, facts, "sm90")
    assert plan_w4a16(facts, None) is None


def test_the_shipped_table_is_readable_and_valid():
    with open(TABLE_PATH) as f:
        data = json.load(f)
    assert data["card"] == "NVIDIA H200" and data["entries"]
    for entry in data["entries"]:
        config = config_from_dict(entry["kernel"], entry["config"])
        assert config_to_dict(config) == entry["config"]  # written in the short form
        assert entry["m"] == m_bucket(entry["m"]) and entry.get("source")
    assert len(load_table()) == len(data["entries"])


def test_a_gluon_entry_naming_a_card_serves_that_cards_exact_cell_only(monkeypatch):
    """A Gluon config measured faster on one card (bench_w4a16_chain.py's candidates) serves that card at exactly
    its (N, K, M bucket); other cards, other buckets and neighbouring shapes keep the generic table's pick (the
    entry is never a nearest shape); a config that does not fit the layer is passed over."""
    from quantkit.kernels import w4a16_select

    card, ring = "NVIDIA H100 80GB HBM3", G(128, 16, 8, 4, 2, X_BOX_K=64)
    shipped = load_table()
    entry = {"n": 4096, "k": 4096, "m": 1, "kernel": "gluon", "config": ring, "us": 5.0, "card": card,
             "source": "test"}
    monkeypatch.setattr(w4a16_select, "load_table", lambda: (entry,) + shipped)  # first: wins any tie
    facts = facts_of(4096, 4096, 4, 128, True, False)
    generic = PINNED_SM90[(4096, 4096, 1)]
    on_card = select_w4a16(1, facts, "sm90", card)
    assert (on_card.kernel, on_card.config) == ("gluon", ring) and card in on_card.reason
    for other in (None, "NVIDIA H200"):
        assert (select_w4a16(1, facts, "sm90", other).kernel, select_w4a16(1, facts, "sm90", other).config) == generic
    assert select_w4a16(4, facts, "sm90", card).config == PINNED_SM90[(4096, 4096, 4)][1]
    near = facts_of(4096, 5120, 4, 128, True, False)
    assert select_w4a16(1, near, "sm90", card).config != ring
    assert select_w4a16(1, near, "sm90", card).config == select_w4a16(1, near, "sm90", None).config
    # a config that cannot take the bucket is passed over: the direct kernel takes at most 8 rows
    wide = dict(entry, m=16, config=G(128, 16, 8, 4, 2, DIRECT=True))
    monkeypatch.setattr(w4a16_select, "load_table", lambda: shipped + (wide,))
    assert select_w4a16(16, facts, "sm90", card).config == PINNED_SM90[(4096, 4096, 16)][1]


def test_a_cutlass_entry_serves_its_card_with_the_generic_pick_as_fallback(monkeypatch):
    """A ``cutlass`` entry (bench_w4a16_prefill.py's candidates) serves its card at exactly its cell, keeping the
    generic pick as the fallback for machines without nvcc or CUTLASS; other cards keep the generic pick."""
    from quantkit.kernels import w4a16_select
    from quantkit.kernels.w4a16_configs import CutlassConfig

    card, cfg = "NVIDIA H100 80GB HBM3", CutlassConfig(128, 256, 2)
    shipped = load_table()
    entry = {"n": 4096, "k": 4096, "m": 2048, "kernel": "cutlass", "config": cfg, "us": 99.0, "card": card,
             "source": "test"}
    monkeypatch.setattr(w4a16_select, "load_table", lambda: (entry,) + shipped)
    facts = facts_of(4096, 4096, 4, 128, True, False)
    generic = select_w4a16(2048, facts, "sm90", None)
    on_card = select_w4a16(2048, facts, "sm90", card)
    assert (on_card.kernel, on_card.config, on_card.fallback) == ("cutlass", cfg, generic)
    assert (generic.kernel, generic.config) == PINNED_SM90[(4096, 4096, 2048)]
    # exactly its cell: not another bucket (256, where the shipped table has no entry for this card)
    assert not any(e.get("card") == card and (e["n"], e["k"], e["m"]) == (4096, 4096, 256) for e in shipped)
    assert select_w4a16(256, facts, "sm90", card) == select_w4a16(256, facts, "sm90", None)
    assert select_w4a16(2048, facts_of(4096, 4096, 4, 32, True, False), "sm90", card).kernel != "cutlass"  # g32


def test_card_specific_entries_serve_their_card_only():
    """The entries that name a card (kernels/w4a16_h200.json, "card") serve that card's plans only. On the H100: the
    CUDA decode kernel at 1 and 8 rows, CUTLASS on the four 8B layers at 1024 and 2048 rows and three at 4096,
    dequantize-then-cuBLAS at 4096. Another card, and a plan without a card, get that card's own entry for the cell
    where it has one, else the Gluon pick (for a CUDA or CUTLASS entry, the same one it falls back to)."""
    h100 = "NVIDIA H100 80GB HBM3"
    table = load_table()
    measured = [e for e in table if e.get("card")]
    assert {(e["n"], e["k"], e["m"], e["kernel"]) for e in measured if e["card"] == h100} >= {
        (28672, 4096, 1, "cuda"), (28672, 4096, 8, "cuda"), (5120, 2048, 1, "cuda"), (5120, 2048, 8, "cuda"),
        (6144, 4096, 2048, "cutlass"), (4096, 4096, 2048, "cutlass"), (28672, 4096, 2048, "cutlass"),
        (4096, 14336, 2048, "cutlass"), (6144, 4096, 4096, "cutlass"), (28672, 4096, 4096, "cutlass"),
        (4096, 14336, 4096, "cutlass"), (6144, 4096, 1024, "cutlass"), (4096, 4096, 1024, "cutlass"),
        (28672, 4096, 1024, "cutlass"), (4096, 14336, 1024, "cutlass"),
        (4096, 4096, 4096, "dequant"), (28672, 8192, 4096, "dequant"), (8192, 28672, 4096, "dequant")}
    own = {(e["n"], e["k"], e["m"], e["card"]): e for e in measured}
    cards = {e["card"] for e in measured} | {"NVIDIA H200"}
    for e in measured:
        facts = facts_of(e["n"], e["k"], 4, 128, True, False)
        on_card = select_w4a16(e["m"], facts, "sm90", e["card"])
        assert on_card.kernel == e["kernel"] and on_card.config == e["config"], on_card
        for card in (cards - {e["card"]}) | {None}:
            elsewhere = select_w4a16(e["m"], facts, "sm90", card)
            theirs = own.get((e["n"], e["k"], e["m"], card))
            if theirs is not None:
                assert (elsewhere.kernel, elsewhere.config) == (theirs["kernel"], theirs["config"]), (card, elsewhere)
                continue
            assert elsewhere.kernel == "gluon", (card, elsewhere)
            assert e["kernel"] not in ("cuda", "cutlass") or elsewhere == on_card.fallback, (card, elsewhere)
        assert plan_w4a16(facts, "sm90", e["card"]).choice(e["m"]) == on_card
        # asymmetric (zero points) layers: every kernel named takes them too (the benches check both)
        assert select_w4a16(e["m"], facts_of(e["n"], e["k"], 4, 128, False, False), "sm90", e["card"]).kernel \
            == e["kernel"]
