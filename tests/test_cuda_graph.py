"""CUDA-graph bookkeeping that needs no GPU: the batch-size ladder, the padding of a decode
batch into the static buffers, the decode graphs' one logits buffer. (Capture and replay run in
scripts/gpu_check.sh.)"""

import numpy as np
import torch

from picovllm.engine.step_launcher import step_inputs
from picovllm.messages import StepInputs
from picovllm.worker.cuda_graph import DecodeGraphs, MixedGraphs, graph_batch_sizes, mixed_graph_sizes
from picovllm.worker.inputs import BlockTables, MixedPadding, Uploader, build_decode, build_eager, build_mixed_graph

CPU_UPLOAD = Uploader(torch.device("cpu"))


def _step(token_ids, context_lens, block_tables, sample=None) -> StepInputs:
    query_lens = np.array([len(t) for t in token_ids], dtype=np.int64)
    sample = np.ones(len(token_ids), dtype=bool) if sample is None else np.array(sample)
    return StepInputs(token_ids, np.array(context_lens, dtype=np.int64), query_lens, block_tables, sample)


def test_batch_size_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]
    assert graph_batch_sizes(10_000)[-1] == 512


def test_padding_rows_are_inert():
    """A decode batch of 3 padded to 4 on the host, then copied over stale buffer contents."""
    buf = DecodeGraphs(None, max_num_seqs=8, max_model_len=20, block_size=4, device=torch.device("cpu"))
    assert buf.block_tables.shape == (8, 5)
    buf.vectors.fill_(99), buf.block_tables.fill_(7)  # stale values
    inputs = build_decode(
        _step([[11], [12], [13]], [5, 9, 17], [[3, 4], [1, 2, 6], [0, 5, 8, 9, 10]]), 4, CPU_UPLOAD, batch_size=4
    )
    assert inputs.logits_indices is None and inputs.meta.max_query_len == 1
    assert buf.fill(inputs) == 4
    ids, positions, meta = buf.args(4)
    assert ids.tolist() == [11, 12, 13, 0]
    assert positions.tolist() == [4, 8, 16, 0]
    assert meta.slot_mapping.tolist() == [4 * 4 + 0, 6 * 4 + 0, 10 * 4 + 0, -1]
    assert meta.context_lens.tolist() == [5, 9, 17, 1]
    assert meta.block_tables[3].tolist() == [0] * 5 and meta.block_tables[0].tolist() == [3, 4, 0, 0, 0]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.max_query_len == 1
    assert buf.vectors[:, 4:].eq(99).all()  # rows past the batch are not touched


def test_block_tables_are_updated_where_they_grew_when_they_continue_the_last_steps():
    """The step's block tables array is kept: a step whose tables continue the last one's (the
    same lists, appended to) has only the grown rows written; any other step rebuilds it. Its
    contents are the tables either way (padding rows and ends of short tables: block 0)."""
    from types import SimpleNamespace

    def request(table):
        return SimpleNamespace(
            block_table=table, num_computed_tokens=4, token_ids=list(range(5)), needs_prompt_logprobs=False
        )

    reqs = [request([3, 4]), request([1]), request([0, 5, 8])]
    batch = SimpleNamespace(requests=reqs, num_new_tokens=[1, 1, 1])
    tables = BlockTables()

    def build(step, rows=4):
        expected = np.zeros((rows, max(len(r.block_table) for r in reqs)), dtype=np.int64)
        for b, r in enumerate(reqs):
            expected[b, : len(r.block_table)] = r.block_table
        assert tables(step, rows).tolist() == expected.tolist()

    first = step_inputs(batch)
    assert not first.tables_continue
    build(first)
    reqs[1].block_table += [9, 10, 11]  # (past the widest: the array widens)
    second = step_inputs(batch, tables_before=first.block_tables)
    assert second.tables_continue
    tables.array[0, 0] = 77  # (a row that did not grow is not written again)
    array = tables(second, 4)
    assert array[0].tolist() == [77, 4, 0, 0] and array[1].tolist() == [1, 9, 10, 11] and array[3].tolist() == [0] * 4
    tables.array[0, 0] = 3
    reqs[0].block_table = [6, 7]  # replaced: another list, so the tables do not continue
    third = step_inputs(batch, tables_before=second.block_tables)
    assert not third.tables_continue
    build(third)
    build(step_inputs(batch, tables_before=third.block_tables), rows=3)  # (another padding: rebuilt)


def test_prefill_inputs_sample_the_last_token_of_each_sequence():
    inputs = build_eager(_step([[5, 6, 7], [8]], [3, 6], [[2], [4, 1]]), 4, CPU_UPLOAD)
    assert inputs.positions.tolist() == [0, 1, 2, 5]
    assert inputs.meta.slot_mapping.tolist() == [8, 9, 10, 1 * 4 + 1]
    assert inputs.logits_indices.tolist() == [2, 3] and inputs.graph_inputs is None
    assert inputs.meta.prefill_work.tolist() == [0]  # sequence 0's one query block (1 is the decode kernel's)


def test_mixed_graph_sizes_and_padding_choice():
    assert mixed_graph_sizes(1) == [16] and mixed_graph_sizes(100) == [16, 32, 48, 64, 80, 96, 112]
    # a quarter of each octave apart (16 tokens at least): a step pads by at most a quarter or 16
    sizes = mixed_graph_sizes(2048)
    assert sizes[-5:] == [1024, 1280, 1536, 1792, 2048] and len(sizes) == 24
    assert all(s % 16 == 0 and s < b <= max(s + 16, s * 5 // 4) for s, b in zip(sizes, sizes[1:]))
    graphs = MixedGraphs(None, 100, max_num_seqs=4, max_model_len=64, block_size=4, device=torch.device("cpu"))
    assert graphs.padding(16, 3) == (16, 4, 9) and graphs.padding(17, 3).tokens == 32
    assert graphs.num_seqs(16) == 4 and graphs.padding(10, 5) is None  # more sequences than captured
    assert graphs.padding(113, 1) is None  # more tokens than the largest graph
    # prefill work: query blocks of 64 of the multi-token sequences, at most 8 more than T / 64
    assert [graphs.work_capacity(t) for t in (16, 64, 80, 112)] == [9, 9, 10, 10]
    assert graphs.padding(16, 3, 9).tokens == 16 and graphs.padding(16, 3, 10).tokens == 80
    assert graphs.padding(65, 3).tokens == 80 and graphs.padding(100, 4).tokens == 112
    assert graphs.layout(16) == (48, 4, 5, 9)


def test_mixed_graph_runs_the_decode_kernel_only_when_a_sequence_decodes():
    """Each token count is captured twice; a step replays the graph without the decode kernel
    exactly when none of its sequences has a single token."""
    graphs = MixedGraphs(None, 32, max_num_seqs=4, max_model_len=64, block_size=4, device=torch.device("cpu"))
    assert graphs.keys() == [(32, True), (32, False), (16, True), (16, False)]
    assert [graphs.args(k)[2].any_single_query for k in graphs.keys()] == [True, False, True, False]

    def key(query_lens):
        step = _step([list(range(n)) for n in query_lens], [n + 4 for n in query_lens], [[1, 2, 3], [4, 5, 6]])
        return graphs.fill(build_mixed_graph(step, 4, CPU_UPLOAD, graphs.padding(16, 2, 2)))

    assert key([5, 1]) == (16, True)  # a prompt chunk and a decode
    assert key([5, 3]) == (16, False)  # two prompt chunks
    ids, positions, meta = graphs.args((16, False))  # what the step's one packed copy put in the graph's buffers
    assert ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2] + [0] * 8
    assert positions.tolist() == [4, 5, 6, 7, 8, 4, 5, 6] + [0] * 8
    assert (
        meta.slot_mapping.tolist()
        == [2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 3 * 4, 5 * 4, 5 * 4 + 1, 5 * 4 + 2] + [-1] * 8
    )
    assert meta.context_lens.tolist() == [9, 7, 0, 0] and meta.query_start_loc.tolist() == [0, 5, 8, 8, 8]
    assert meta.prefill_work.tolist() == [0, 1 << 16] + [-1] * 7
    assert meta.block_tables[:2].tolist() == [[1, 2, 3] + [0] * 13, [4, 5, 6] + [0] * 13]
    assert key([1, 1]) == (16, True)


def test_padded_mixed_step_computes_what_the_unpadded_one_does(tiny_qwen):
    """A decode and a prompt chunk in one step, padded as a mixed-step graph would take it
    (16 tokens, 4 sequences), run through the same forward: the sampled rows' logits are those
    of the unpadded step, and the padding stored nothing."""
    from conftest import make_llm

    from picovllm import SamplingParams

    llm = make_llm(
        tiny_qwen[0],
        skip_tokenizer_init=True,
        block_size=4,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        enable_prefix_caching=False,
        async_scheduling=False,
    )  # scheduled by hand below
    engine = llm.llm_engine
    runner = engine.executor.driver.model_runner
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(10, 16)), params)
    engine.step()
    engine.add_request("b", list(range(30, 50)), params)
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [1, 11] and not batch.is_decode
    free_before = engine.block_manager.num_free_blocks
    caches = [t.clone() for t in runner.kv_cache[0]]
    unpadded = runner.step_logits(step_inputs(batch))
    stored = [t.clone() for t in runner.kv_cache[0]]

    class EagerMixed:  # MixedGraphs' padding without the graphs
        computes_logits = False
        padding = staticmethod(lambda tokens, seqs, work_items: MixedPadding(16, 4, 3))
        run = staticmethod(lambda inputs: runner.model(inputs.input_ids, inputs.positions, inputs.meta))

    for t, saved in zip(runner.kv_cache[0], caches):
        t.copy_(saved)
    runner.mixed_graphs = EagerMixed()
    with torch.inference_mode():  # as the engine calls it (on CUDA, the upload buffers are inference tensors)
        inputs, graphs = runner.prepare(step_inputs(batch))
    assert (
        graphs is runner.mixed_graphs and inputs.input_ids.shape == (16,) and inputs.meta.slot_mapping[12:].eq(-1).all()
    )
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 12, 12, 12] and inputs.meta.context_lens.tolist()[2:] == [
        0,
        0,
    ]
    assert inputs.meta.prefill_work.tolist() == [1 << 16, -1, -1]  # b's one query block; a is the decode kernel's
    padded = runner.step_logits(step_inputs(batch))
    torch.testing.assert_close(padded, unpadded, atol=1e-5, rtol=1e-5)
    for t, expected in zip(runner.kv_cache[0], stored):
        torch.testing.assert_close(t, expected, atol=1e-5, rtol=1e-5)
    assert engine.block_manager.num_free_blocks == free_before


def test_decode_graphs_give_each_size_its_rows_of_one_logits_buffer(monkeypatch):
    """Captured largest first, the decode graphs' logits share the largest's output: each smaller
    graph copies its rows to the top of it (what capture() records, here run on the CPU as if
    capturing)."""

    class Model:  # hidden: the input ids as a column; logits: the ids times (1, 2, 3)
        def __call__(self, ids, positions, meta):
            return ids[:, None].float()

        def compute_logits(self, hidden):
            return hidden * torch.tensor([1.0, 2.0, 3.0])

    graphs = DecodeGraphs(Model(), max_num_seqs=8, max_model_len=20, block_size=4, device=torch.device("cpu"))
    graphs.vectors[0] = torch.arange(100, 108)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert graphs.forward(8, graphs.args(8)).shape == (8, 3) and graphs.logits is None  # (a warm-up: no buffer)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    outputs = {size: graphs.forward(size, graphs.args(size)) for size in graphs.keys()}
    assert list(outputs) == [8, 4, 2, 1] and graphs.logits.shape == (8, 3)
    for size, logits in outputs.items():
        assert logits.data_ptr() == graphs.logits.data_ptr() and logits.shape == (size, 3)
    graphs.vectors[0] = torch.arange(200, 208)
    assert graphs.forward(2, graphs.args(2)).tolist() == [[200, 400, 600], [201, 402, 603]]
    assert graphs.logits[:, 0].tolist() == [200, 201, 102, 103, 104, 105, 106, 107]  # (size 8's rows past 2 kept)


def test_padded_decode_step_gives_the_logits_of_the_unpadded_one(tiny_qwen):
    """A decode batch of 3 through a decode graph's path (padded to 4, the graph giving the
    logits of every row, here run eagerly): the step's logits are the unpadded step's, its three
    rows alone."""
    from conftest import make_llm

    from picovllm import SamplingParams

    llm = make_llm(tiny_qwen[0], skip_tokenizer_init=True, block_size=4, max_num_seqs=4, async_scheduling=False)
    engine = llm.llm_engine
    runner = engine.executor.driver.model_runner
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), list(range(10 + i, 17 + 2 * i)), params)
    engine.step()
    batch = engine.scheduler.schedule()
    assert batch.is_decode and len(batch.requests) == 3
    caches = [t.clone() for t in runner.kv_cache[0]]
    unpadded = runner.step_logits(step_inputs(batch))

    class EagerDecode:  # DecodeGraphs' padding and logits without the graphs
        computes_logits = True
        padded_size = staticmethod(lambda batch: 4)

        @staticmethod
        def run(inputs):
            assert inputs.input_ids.shape == (4,)
            return runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions, inputs.meta))

    for t, saved in zip(runner.kv_cache[0], caches):
        t.copy_(saved)
    runner.graphs = EagerDecode()
    padded = runner.step_logits(step_inputs(batch))
    assert padded.shape == unpadded.shape == (3, runner.model_cfg.vocab_size)
    torch.testing.assert_close(padded, unpadded, atol=1e-5, rtol=1e-5)
