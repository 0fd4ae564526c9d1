"""The experience pool on a real redis-server, with the real MiniLM embedder.

``embedder`` is the session fixture in conftest.py: the model loads once (a few seconds).

Similarities quoted below were measured with the bundled all-MiniLM-L6-v2. Task-style queries
score only about 0.4-0.7 against the when_to_use they should match, so retrieval tests use a
threshold of 0.35 and check ranking; unrelated text stays near 0.1.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import msgpack
import numpy as np
import pytest

from autodidact.embedded_redis import EmbeddedRedis
from inference.embedder import Embedder
from navigating.pool import ExperiencePool, _pack_entry, experience_id
from protocol.control import Keys
from protocol.messages import Experience

MKDIR = ("move a file into a folder that does not exist yet",
         "create the folder first with mkdir, then mv the file into it")
FILE_SYSTEM = [
    MKDIR,
    ("rename a file", "use mv old_name new_name in the same folder"),
    ("delete a folder and all the files in it",
     "rm each file inside first, then go back up with cd .. and rm the folder"),
    ("show the contents of a file", "use cat with the file name"),
    ("find the files that contain a word", "use grep with the word and the file names"),
    ("go to a folder inside another folder", "cd one level at a time: the outer, then the inner"),
]
# query -> index in FILE_SYSTEM; measured cosine to the right one (best wrong one)
QUERIES = {
    "create folder archive and move report.txt into it": 0,  # 0.51 (0.38)
    "rename notes.md to ideas.md": 1,  # 0.44 (0.18)
    "delete folder build and everything in it": 2,  # 0.68 (0.33)
    "show the contents of todo.txt": 3,  # 0.57 (0.29)
    "find the files that mention budget": 4,  # 0.41 (0.30)
    "go to folder helpers in src": 5,  # 0.47 (0.36)
    "remove the build folder with all its files": 2,  # 0.56 (0.34)
    "which files contain the word budget": 4,  # 0.47 (0.26)
}


def exp(when: str, content: str, kind: str = "success", **kw) -> Experience:
    return Experience(exp_id=experience_id(when, content), when_to_use=when, content=content,
                      kind=kind, **kw)


@pytest.fixture
def make_pool(redis_url, embedder):
    """Pools on one fresh prefix; each call is another process's view of the same pool."""
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    pools = []

    def make(**kw) -> ExperiencePool:
        pools.append(ExperiencePool.connect(redis_url, prefix, embedder, **kw))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def fs_pool(make_pool):
    pool = make_pool()
    assert pool.add([exp(w, c) for w, c in FILE_SYSTEM])["added"] == len(FILE_SYSTEM)
    return pool


# --- retrieval ---


@pytest.mark.parametrize("query", QUERIES)
def test_retrieve_ranks_the_relevant_experience_first(fs_pool, query):
    got = fs_pool.retrieve(query, top_k=3, min_similarity=0.35)
    assert got and got[0][0].when_to_use == FILE_SYSTEM[QUERIES[query]][0]
    sims = [s for _, s in got]
    assert sims == sorted(sims, reverse=True) and sims[-1] >= 0.35


def test_retrieve_thresholds(fs_pool):
    # the config default threshold (0.5) still lets the closest task-style match through
    (best, sim), *_ = fs_pool.retrieve("delete folder build and everything in it")
    assert best.when_to_use == FILE_SYSTEM[2][0] and sim > 0.6
    # unrelated text stays below 0.11 against every experience
    assert fs_pool.retrieve("what is the capital of France", top_k=6, min_similarity=0.3) == []
    assert fs_pool.retrieve("how do I bake bread", top_k=6, min_similarity=0.3) == []
    assert len(fs_pool.retrieve("rename notes.md to ideas.md", top_k=6, min_similarity=-1)) == 6


def test_equal_similarity_goes_to_higher_utility_then_older(make_pool):
    pool = make_pool()
    first = exp("rename a file", "use mv old_name new_name", created_at=100.0)
    second = exp("rename a file", "copy it with cp, then rm the old one", created_at=200.0)
    assert pool.add([first, second])["added"] == 2  # same situation, different advice
    top = [e.exp_id for e, _ in pool.retrieve("rename a.txt to b.txt", top_k=2, min_similarity=0)]
    assert top == [first.exp_id, second.exp_id]
    pool.record_use([first.exp_id], success=False)
    pool.record_use([second.exp_id], success=True)
    got = pool.retrieve("rename a.txt to b.txt", top_k=1, min_similarity=0)
    assert [(e.exp_id, e.uses, e.successes) for e, _ in got] == [(second.exp_id, 1, 1)]


def test_equal_similarity_goes_to_the_preferred_kind_before_utility(make_pool):
    pool = make_pool()
    contrast = exp("rename a file", "first do cd src ; not cd docs", kind="contrast",
                   created_at=100.0)
    worked = exp("rename a file", "worked : cd src ; mv a.txt b.txt", created_at=200.0)
    assert pool.add([contrast, worked])["added"] == 2
    pool.record_use([contrast.exp_id], success=True)  # the higher utility, yet ranked second
    got = pool.retrieve("rename a file", top_k=2, min_similarity=0.9,
                        kind_order=["success", "contrast"])
    assert [e.exp_id for e, _ in got] == [worked.exp_id, contrast.exp_id]
    got = pool.retrieve("rename a file", top_k=2, min_similarity=0.9)
    assert [e.exp_id for e, _ in got] == [contrast.exp_id, worked.exp_id]  # no order: utility


# --- writing ---


def test_add_rejects_duplicates_invalid_and_overflow(make_pool):
    pool = make_pool(max_chars=80)
    assert pool.add([exp(*MKDIR)])["added"] == 1
    counts = pool.add([
        exp(*MKDIR),  # the same id again
        # a near-verbatim rewording: 0.997 / 0.998 on the two texts
        exp("move a file into a folder that doesn't exist yet",
            "create the folder first with mkdir and then mv the file into it"),
        # the same situation with other advice (content at 0.48): new
        exp(MKDIR[0], "check the folder exists with ls before moving the file"),
        exp("rename a file", "use mv old_name new_name in the same folder"),
        # the same as the previous one but for whitespace: the same id, caught in this call
        exp("rename  a file", "use mv old_name new_name in the same folder"),
        exp("  ", "some advice"),
        exp("a situation", ""),
        exp("a situation", "x" * 81),
        exp("a situation", "advice", confidence=1.5),
    ])
    assert counts == {"added": 2, "duplicate": 3, "empty": 2, "too_long": 1, "invalid": 1,
                      "pool_full": 0}
    assert pool.size() == 3 and len(pool.all()) == 3
    # a paraphrase within one call is caught against the earlier one
    counts = pool.add([exp("delete a file", "use rm with the file name"),
                       exp("delete a file", "use rm with the file's name")])
    assert (counts["added"], counts["duplicate"]) == (1, 1)


def test_add_fills_id_and_time_and_respects_max_pool(make_pool, monkeypatch):
    pool = make_pool(max_pool=2)
    loose = Experience(exp_id="", when_to_use="rename a file", content="use mv")
    counts = pool.add([loose, exp(*MKDIR), exp("show the contents of a file", "use cat")])
    assert (counts["added"], counts["pool_full"]) == (2, 1)
    stored = pool.get(experience_id("rename a file", "use mv"))
    assert stored is not None and stored.created_at > 0 and loose.created_at == 0
    assert pool.stats() == {"size": 2, "corrupt": 0, "kind/success": 2}
    # Full: what comes next is refused without being embedded (the log never shrinks).
    calls = []
    monkeypatch.setattr(pool.embedder, "encode", calls.append)  # the session's embedder
    assert pool.add([exp("list a folder", "use ls")])["pool_full"] == 1 and not calls


# --- sharing and durability ---


def test_pools_on_one_prefix_share_experiences_and_counters(make_pool):
    a, b = make_pool(), make_pool(refresh_s=3600)
    b.retrieve("anything")  # b's copy is now fresh, and will not refresh by itself for an hour
    a.add([exp(*MKDIR)])
    query = "create folder archive and move report.txt into it"
    assert b.retrieve(query, min_similarity=0.35) == []
    assert b.refresh() == 1 and b.retrieve(query, min_similarity=0.35)
    assert b.add([exp(*MKDIR)])["duplicate"] == 1

    exp_id = experience_id(*MKDIR)
    a.record_use([exp_id], success=True)
    b.record_use([exp_id, exp_id], success=False)  # one rollout counts once

    def hammer(pool: ExperiencePool):
        for _ in range(50):
            pool.record_use([exp_id], success=True)

    threads = [threading.Thread(target=hammer, args=(p,)) for p in (make_pool(), make_pool())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = a.get(exp_id)
    assert (got.uses, got.successes) == (102, 101)


def test_the_pool_writes_only_the_keys_protocol_control_names(make_pool):
    pool = make_pool()
    pool.add([exp(*MKDIR)])
    pool.record_use([experience_id(*MKDIR)], success=True)
    prefix = pool.keys.log.rsplit(":exp:", 1)[0]
    written = {k.decode() for k in pool.r.scan_iter(match=f"{prefix}:*")}
    named = Keys(prefix).experience
    assert written == {named.log, named.ids, named.uses, named.successes}


def test_pool_survives_a_redis_restart(embedder, tmp_path):
    exps = [exp(w, c, kind=k) for (w, c), k in zip(FILE_SYSTEM[:3], ["success", "failure", "llm"])]
    with EmbeddedRedis(tmp_path) as url:
        pool = ExperiencePool.connect(url, "autodidact:run", embedder)
        pool.add(exps)
        pool.record_use([exps[0].exp_id, exps[1].exp_id], success=True)
        pool.record_use([exps[0].exp_id], success=False)
        before = pool.all()
        pool.close()
    # the server stopped on SIGTERM, which flushes the append-only file
    with EmbeddedRedis(tmp_path) as url:
        pool = ExperiencePool.connect(url, "autodidact:run", embedder)
        after = pool.all()
        hit = pool.retrieve("delete folder build and everything in it")
        pool.close()
    assert after == before
    assert [(e.uses, e.successes) for e in after] == [(2, 1), (1, 1), (0, 0)]
    assert hit[0][0].exp_id == exps[2].exp_id


def test_corrupt_entries_are_skipped_and_counted(make_pool, embedder):
    writer = make_pool()
    writer.add([exp(*MKDIR)])
    vec = np.ones(8, dtype=np.float32) / np.sqrt(8)
    writer.r.rpush(writer.keys.log,
                   b"\xc1 not msgpack",
                   msgpack.packb({"exp": b"\x01", "w": b"", "c": b""}),
                   _pack_entry(exp("a", "b"), vec, vec))  # another model's dimension
    writer.add([exp("rename a file", "use mv")])
    reader = make_pool()
    assert [e.when_to_use for e in reader.all()] == [MKDIR[0], "rename a file"]
    assert reader.corrupt == 3 and reader.size() == 5
    assert reader.stats()["corrupt"] == 3
    assert reader.retrieve("rename notes.md to ideas.md", min_similarity=0.35)


# --- ids and the embedder ---


def test_experience_id_is_stable():
    assert experience_id("rename  a file\n", "use mv") == experience_id("rename a file", "use mv")
    assert experience_id("rename a file", "use mv") != experience_id("rename a file", "use cp")
    assert len(experience_id("a", "b")) == 16


def test_embedder_caches_each_text(embedder, monkeypatch):
    calls = []
    encode = embedder.model.encode

    def counting(texts, **kw):
        calls.append(list(texts))
        return encode(texts, **kw)

    monkeypatch.setattr(embedder.model, "encode", counting)
    a, b = f"cache me {uuid.uuid4().hex}", f"and me {uuid.uuid4().hex}"  # new to the cache
    first = embedder.encode([a, b, a])
    again = embedder.encode([b, a])
    assert calls == [[a, b]]
    assert first.dtype == np.float32 and first.shape == (3, embedder.dim) == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(again, first[[1, 2]])


def test_embedder_missing_model_and_cheap_import(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-model-here"):
        Embedder(str(tmp_path / "no-model-here")).encode(["x"])
    code = ("import sys, inference.embedder; "
            "assert not {'torch', 'sentence_transformers'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)



class _CountingModel:
    """A stand-in SentenceTransformer: the cache under test never looks inside the vectors."""

    def encode(self, texts, **_):
        return np.random.default_rng(len(texts)).normal(size=(len(texts), 384))


def test_the_embedders_cache_holds_its_rows_and_no_batch_behind_them():
    # The soak of the default job saw the experience worker grow by 160 MB with its pool
    # full: each cached row was a view keeping its whole batch (hundreds of rows) alive.
    embedder = Embedder(cache_size=100)
    embedder._model, embedder._dim = _CountingModel(), 384
    for batch in range(50):
        embedder.encode([f"text {batch} {i}" for i in range(400)] + ["asked every time"])
    cached = list(embedder._cache.values())
    assert len(cached) == 100 and all(v.base is None for v in cached)
    held = sum(v.nbytes for v in cached)
    assert held == 100 * 384 * 4  # what the cache holds is its own rows, nothing more
