# libkvclient (rpm %post and %postun): refresh the loader cache.
/sbin/ldconfig
exit 0
