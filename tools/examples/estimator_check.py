"""What the Estimator examples share: the check that tf.estimator exists."""

import os
import sys

import tensorflow as tf


def require_estimator():
  """Exits with one line when this TensorFlow has no tf.estimator."""
  if not hasattr(tf.compat.v1, 'estimator'):
    sys.exit('%s needs TensorFlow 2.15, the last release with tf.estimator; '
             'this is TensorFlow %s. Install it with pip install '
             '".[estimator]" (Python 3.9 to 3.11).' %
             (os.path.basename(sys.argv[0]), tf.__version__))
