"""absl's `app.run` for the guides, with a help flag exiting 0.

absl prints the usage for `--help` and then exits 1, which shells and CI
read as a failure; a guide asked for its help has done what it was asked.
"""

import sys

from absl import app

_HELP_FLAGS = ('--help', '--helpshort', '--helpfull', '-?', '-h')


def run(main):
  """Runs `main` as `absl.app.run` does; a help flag prints usage, exits 0.

  Args:
    main: the guide's main function, called with the arguments left after
      flag parsing.

  Raises:
    SystemExit: always, with `main`'s status (0 after printing the usage
      for `--help`, `--helpshort`, `--helpfull`, `-?` or `-h`).
  """
  if not any(arg in _HELP_FLAGS for arg in sys.argv[1:]):
    app.run(main)
  argv = [('--help' if arg == '-h' else arg) for arg in sys.argv]
  try:
    app.run(main, argv=argv)
  except SystemExit as done:
    sys.exit(0 if done.code in (0, 1, None) else done.code)
