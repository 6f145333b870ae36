# mk/rpm.mk: `make rpm` builds the syshax RPM from the working tree into rpm/build/ (include from the top-level Makefile).
#
# The spec, rpm/syshax.spec, is an openEuler spec: its %pyproject_* and
# %systemd_* macros come from openEuler's python3-rpm-macros /
# pyproject-rpm-macros and systemd-rpm-macros. Debian's rpm ships neither, so
# this build loads working stand-ins from rpm/macros.stand-in with --load.
# On openEuler, run `make rpm-tarball`, then rpmbuild without --load/--nodeps.
#
# Needs: rpm (rpmbuild), GNU tar, sed, and RPM_PYTHON with pip, setuptools, wheel.

# The repository root: the directory above this file, wherever make runs from.
RPM_REPO   := $(abspath $(dir $(lastword $(MAKEFILE_LIST)))..)
RPM_PYTHON ?= $(RPM_REPO)/.venv/bin/python
RPM_TOPDIR ?= $(RPM_REPO)/rpm/build
RPM_MACROS ?= $(RPM_REPO)/rpm/macros.stand-in
RPM_SPEC   := $(RPM_REPO)/rpm/syshax.spec
# RPM_TARGET=aarch64 (a Kunpeng server's arch) or x86_64: rpmbuild --target; the package is noarch (it carries no
# native code: llama-wheel.sh builds llama.cpp on the host it runs on), so it comes out the same for either
RPM_TARGET ?=

# What goes into Source0: the working tree as it is (committed or not), minus
# the venv, models, build outputs and VCS data, which are never listed here.
RPM_SOURCE_FILES := pyproject.toml README.md systemd/syshaxd.service mk/llama-wheel.sh mk/llama-patches.sh
RPM_SOURCE_TREES := syshaxd plugins mk/patches

RPM_VERSION      = $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' $(RPM_REPO)/syshaxd/__init__.py)
RPM_SPEC_VERSION = $(shell sed -n 's/^Version:[[:space:]]*//p' $(RPM_SPEC))
RPM_TARBALL      = $(RPM_TOPDIR)/SOURCES/syshax-$(RPM_VERSION).tar.gz

.PHONY: rpm rpm-tarball rpm-clean

rpm: rpm-tarball
	@# --nodeps: the BuildRequires (python3-devel, pyproject-rpm-macros,
	@# systemd-rpm-macros, ...) are openEuler rpm names; on this Debian host
	@# the same tools come from apt and the venv, and no rpm database knows
	@# them, so rpmbuild's build-dependency check could only fail.
	@# --target reads the macro files again and drops --load's: with it, the stand-ins go last in the macro path
	rpmbuild -bb --nodeps \
	    $(if $(RPM_TARGET),--target $(RPM_TARGET) --macros "$$(rpm --showrc | sed -n 's/^Macro path: //p'):$(RPM_MACROS)",\
	    --load "$(RPM_MACROS)") \
	    --define "_topdir $(RPM_TOPDIR)" \
	    --define "syshax_build_python $(RPM_PYTHON)" \
	    "$(RPM_SPEC)"
	@ls -1 $(RPM_TOPDIR)/RPMS/noarch/syshax-$(RPM_VERSION)-*.rpm

rpm-tarball:
	@test -n "$(RPM_VERSION)" || { echo "mk/rpm.mk: no __version__ = \"...\" line in syshaxd/__init__.py" >&2; exit 1; }
	@test "$(RPM_VERSION)" = "$(RPM_SPEC_VERSION)" || { \
	    echo "mk/rpm.mk: rpm/syshax.spec has Version: $(RPM_SPEC_VERSION) but syshaxd.__version__ is $(RPM_VERSION);" \
	         "bump the spec's Version and add a %changelog entry" >&2; exit 1; }
	@for f in $(RPM_SOURCE_FILES) $(RPM_SOURCE_TREES); do \
	    test -e "$(RPM_REPO)/$$f" || { echo "mk/rpm.mk: $$f is missing; the RPM packages it" >&2; exit 1; }; \
	done
	@test -x "$(RPM_PYTHON)" || { echo "mk/rpm.mk: RPM_PYTHON=$(RPM_PYTHON) is not an executable python" >&2; exit 1; }
	@mkdir -p $(RPM_TOPDIR)/SOURCES
	tar -C $(RPM_REPO) -czf $(RPM_TARBALL) --sort=name --owner=0 --group=0 --numeric-owner \
	    --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
	    --transform 's,^,syshax-$(RPM_VERSION)/,' \
	    $(RPM_SOURCE_FILES) $(RPM_SOURCE_TREES)

rpm-clean:
	rm -rf $(RPM_TOPDIR)
