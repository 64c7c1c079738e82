"""The project's root of input errors, each said in one line.

What a user gave (a config value, a file, a dataset row, a checkpoint, an engine's reply) is wrong,
and the message says what and where in one line.

Command-line tools turn a ``UserInputError`` into exit code 2 and that line. Every other exception
is a bug in this package (or in a library it calls) and keeps its traceback. Subclasses stay
``ValueError`` for callers that caught the older, looser type.
"""


class UserInputError(ValueError):
    """Input a user can fix; ``str(err)`` is one line naming the problem and where it is."""


class MissingInputError(UserInputError, FileNotFoundError):
    """A file or directory the user named (a model, a dataset, a checkpoint) is not there."""


class OutputExistsError(UserInputError, FileExistsError):
    """An output the user named exists already and would be replaced."""


class DatasetError(UserInputError):
    """A dataset file or one of its rows cannot be used; the message names the file and the row."""


class MetricsLogError(UserInputError):
    """A run's metrics log (``metrics.jsonl``) the user named cannot be read or holds no metrics."""
