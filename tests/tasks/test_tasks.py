"""polaformer.tasks' docstring lists the task packages there are, no more and no fewer."""
import re
from pathlib import Path

import polaformer.tasks


def test_the_package_docstring_names_every_task():
    folder = Path(polaformer.tasks.__file__).parent
    tasks = sorted(p.name for p in folder.iterdir() if (p / "__init__.py").exists())
    assert len(tasks) >= 7
    assert sorted(re.findall(r"^- :mod:`\.(\w+)`", polaformer.tasks.__doc__, flags=re.M)) == tasks
