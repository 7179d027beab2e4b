"""Map the repository's top-level folders to import names under `shoal`.

docs/architecture.md "Layout": `services/`, `shared/`, `kernels/` are imported as `shoal.services`,
`shoal.shared`, `shoal.kernels`; nothing else is installed at the top level.
"""

from setuptools import find_packages, setup

FOLDERS = {"shoal": "shoal", "shoal.services": "services", "shoal.shared": "shared",
           "shoal.kernels": "kernels"}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in FOLDERS.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
