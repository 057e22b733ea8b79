"""Request rings: a row that changes hands is emptied in every layer before the next step."""
import torch

from oscar_vllm import window_store


def test_rows_handed_to_new_requests_are_emptied_in_every_layer(monkeypatch):
    monkeypatch.setattr(window_store, "_window_positions", [])
    monkeypatch.setattr(window_store, "_pending_resets", set())
    layers = [torch.arange(12, dtype=torch.int32).view(4, 3) for _ in range(2)]
    for pos in layers:
        window_store.register_window_positions(pos)
    window_store.request_row_assigned(2)
    window_store.request_row_assigned(0)
    window_store.apply_resets()
    for pos in layers:
        assert pos[[0, 2]].eq(-1).all() and torch.equal(pos[[1, 3]], torch.tensor([[3, 4, 5], [9, 10, 11]], dtype=torch.int32))
    layers[0][0] = 7
    window_store.apply_resets()  # nothing pending: nothing emptied twice
    assert layers[0][0].eq(7).all()


def test_batch_rows_are_what_the_runner_gave():
    rows = torch.tensor([5, 1, 3], dtype=torch.int32)
    window_store.set_batch_rows(rows)
    assert window_store.batch_rows() is rows
