# kvcellar: kv-server, kv-mds, kvctl, libkvclient and the Python package
# `kvcellar`, installed from the packages in dist/ (scripts/package.sh builds
# them and then this image; no toolchain is fetched here). The command picks
# the role:
#   docker run kvcellar kv-server --listen 0.0.0.0:7700 --dirs /var/lib/kvcellar/disk0 --cap 64G ...
#   docker run kvcellar kv-mds --listen 0.0.0.0:7480 --etcd etcd1:2379,...
#   docker run kvcellar kvctl ring --mds mds1:7480 --group prod
#   docker run -it kvcellar python3      (import kvcellar)
# Runs as the unprivileged user kvcellar; pages live under the volume
# /var/lib/kvcellar. The base image is a minimal Debian made by
# scripts/base-image.sh (debootstrap), since no registry is reachable.
ARG BASE=kvcellar-base:bookworm
FROM ${BASE}
ARG VERSION
COPY dist/kv-server_${VERSION}-1_amd64.deb dist/kv-mds_${VERSION}-1_amd64.deb dist/kvctl_${VERSION}-1_amd64.deb dist/libkvclient_${VERSION}-1_amd64.deb /tmp/pkgs/
COPY dist/kvcellar-${VERSION}-py3-none-manylinux_2_28_x86_64.whl /tmp/pkgs/
# A wheel is a zip of the installed tree: unpacked into the system
# site-packages it is installed, without pip in the image.
# The service user with fixed ids (900:900), made before the packages
# (whose postinst keeps an existing kvcellar user): Kubernetes manifests
# name them (runAsUser, fsGroup; packaging/k8s/).
RUN groupadd --system --gid 900 kvcellar \
 && useradd --system --uid 900 --gid 900 --home-dir /var/lib/kvcellar --no-create-home \
      --shell /usr/sbin/nologin kvcellar \
 && dpkg -i /tmp/pkgs/*.deb \
 && python3 -m zipfile -e /tmp/pkgs/kvcellar-${VERSION}-py3-none-manylinux_2_28_x86_64.whl /usr/lib/python3/dist-packages/ \
 && python3 -c "import kvcellar, kvcellar._native as n; n.load()" \
 && rm -rf /tmp/pkgs /usr/share/man/* /usr/share/doc/*
USER kvcellar
WORKDIR /var/lib/kvcellar
VOLUME ["/var/lib/kvcellar"]
EXPOSE 7700 7480 9700
# Finds the kv-server or kv-mds of this container and asks it (no curl
# needed); containers running kvctl or python3 have nothing to check.
HEALTHCHECK --interval=5s --timeout=5s --start-period=10s --retries=3 \
  CMD ["kvctl", "--timeout-ms", "3000", "health", "--local", "--none-ok"]
CMD ["kvctl", "--help"]
