"""Installs deferred_grad.

TensorFlow is not a hard requirement: pick the build you want with an extra,
`pip install ".[tf]"` (tensorflow) or `pip install ".[tf-cpu]"`
(tensorflow-cpu), or install TensorFlow yourself first.
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
        'tf': ['tensorflow>=2.15'],
        'tf-cpu': ['tensorflow-cpu>=2.15'],
        'test': ['pytest'],
        'plot': ['matplotlib'],
    },
    license='Apache-2.0',
    classifiers=[
        'Programming Language :: Python :: 3',
        'License :: OSI Approved :: Apache Software License',
    ],
)
