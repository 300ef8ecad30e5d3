"""A study's journal after a torn write (a killed process, a full disk): the tuner moves it aside,
keeps the records that parse, and resumes with the trials they hold."""
from __future__ import annotations

import logging

import optuna
import pytest
from test_tuner import SHAPE, WIDTHS, FakeEvaluator, _settings

from pairgen.ops.contact import CONTACT
from pairgen.tuning.tuner import repair_journal, study_name, tune_shape

NAME = study_name("fake-gpu", "contact", "float32", WIDTHS, 64)


def _load(journal):
    """The study as a fresh process loads it, without the tuner's repair."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    return optuna.load_study(study_name=NAME, storage=storage)


def _finished(study):
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    return study.get_trials(states=states)


# Half a record, as a write cut short leaves it: with and without the newline that ends a line.
TORN_TAILS = [b'{"op_code":6,"worker_id":"w","trial_id":3,"sta', b'{"op_code":6,"worker_id":"w","trial_id":3,"sta\n']


@pytest.mark.parametrize("tail", TORN_TAILS, ids=["no-newline", "newline"])
def test_a_torn_journal_is_moved_aside_and_the_study_resumes(tmp_path, caplog, tail):
    tune_shape(CONTACT, SHAPE, FakeEvaluator(), "fake-gpu", _settings(8), storage_dir=tmp_path)
    journal = tmp_path / f"{NAME}.journal"
    assert not repair_journal(journal), "a sound journal must be left alone"
    journal.write_bytes(journal.read_bytes() + tail)

    second = FakeEvaluator()
    with caplog.at_level(logging.WARNING, logger="pairgen"):
        result = tune_shape(CONTACT, SHAPE, second, "fake-gpu", _settings(12), storage_dir=tmp_path)
    assert result.counts["evaluated"] == 12
    assert len(second.compiled) == 4, "the resumed run should keep the 8 trials before the torn record"

    (aside,) = tmp_path.glob(f"{NAME}.journal.corrupt-*")
    assert aside.read_bytes().endswith(tail), "the moved-aside journal keeps every byte, for a post-mortem"
    assert str(journal) in caplog.text and str(aside) in caplog.text
    # The repaired journal loads on its own, holding both runs' trials. Before the repair, the
    # second run appended onto the torn line and this load raised a JSONDecodeError.
    assert len(_finished(_load(journal))) >= 12


def test_records_after_a_bad_one_are_dropped(tmp_path):
    """Optuna numbers trials as it replays their records: the good records after a lost one
    could land on the wrong trial, so only the prefix before it is kept."""
    journal = tmp_path / "x.journal"
    journal.write_bytes(b'{"a":1}\n{"b":2}\nnot json\n{"c":3}\n')
    assert repair_journal(journal)
    assert journal.read_bytes() == b'{"a":1}\n{"b":2}\n'
    (aside,) = tmp_path.glob("x.journal.corrupt-*")
    assert aside.read_bytes().endswith(b'{"c":3}\n')
