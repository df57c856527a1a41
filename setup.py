"""Installs deferred_grad.

TensorFlow is not a hard requirement: pick the build you want with an extra,
`pip install ".[tf]"` (tensorflow) or `pip install ".[tf-cpu]"`
(tensorflow-cpu), or install TensorFlow yourself first. Estimator and
TPUEstimator users need TensorFlow 2.15, the last with `tf.estimator`:
`pip install ".[estimator]"` (Python 3.9 to 3.11; on a newer Python the
install fails: no TensorFlow 2.15 wheel).
"""

import setuptools

setuptools.setup(
    name='deferred_grad',
    version='0.1.0',
    description=('Gradient accumulation for TensorFlow 1 style graph training '
                 '(tf.compat.v1): train as if the batch were K times larger.'),
    long_description=open('README.md').read(),
    long_description_content_type='text/markdown',
    packages=['deferred_grad'],
    python_requires='>=3.9',
    install_requires=['six', 'absl-py'],
    extras_require={
        # Tested: 2.15 to 2.21; a newer TensorFlow imports with a warning.
        'tf': ['tensorflow>=2.15'],
        'tf-cpu': ['tensorflow-cpu>=2.15'],
        # tf.estimator (Estimator, TPUEstimator) ends with TensorFlow 2.15,
        # which has wheels for Python 3.9 to 3.11 only: on a newer Python
        # the install fails (no matching distribution), rather than install
        # no TensorFlow and fail at the first import.
        'estimator': ['tensorflow-cpu==2.15.1',
                      'tensorflow-estimator==2.15.0'],
        'test': ['pytest'],
        'plot': ['matplotlib'],
    },
    license='Apache-2.0',
    classifiers=[
        'Programming Language :: Python :: 3',
        'Programming Language :: Python :: 3.9',
        'Programming Language :: Python :: 3.10',
        'Programming Language :: Python :: 3.11',
        'Programming Language :: Python :: 3.12',
        'Programming Language :: Python :: 3.13',
        'License :: OSI Approved :: Apache Software License',
    ],
)
